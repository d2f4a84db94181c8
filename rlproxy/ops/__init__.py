"""Operations: metrics (metrics.py), the /healthz object (health.py), logs, `rlproxy status`,
progress bars and the dashboard (ui/).

Reads what components report (their typed stats and `health()`), by the app keys in appkeys.py;
imports none of them. The dashboard answers JSON with api/edge.py's `json_response`.
"""
