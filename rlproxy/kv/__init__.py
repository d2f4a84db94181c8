"""The prefix KV cache: prompt KV state kept in memory and on disk, found by longest prefix.

Owns its entries' keys and bytes, the index over them, and which adapter versions' KV may be
reused. Used by the engine only; knows nothing of requests or sessions.
"""
