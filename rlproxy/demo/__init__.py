"""`rlproxy demo`: watch the proxy learn a small task, and the eval gate refuse a bad update."""
