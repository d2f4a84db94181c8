"""Operations: metrics (metrics.py), the /healthz object (health.py), logs, `rlproxy status`,
progress bars, the dashboard (ui/), and `rlproxy serve` run as a subprocess for tests and
benchmarks (served.py).

Reads what components report (their typed stats and `health()`), by the app keys in appkeys.py;
imports none of them. The dashboard answers JSON with protocol.py's `json_response`.
"""
