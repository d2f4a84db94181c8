"""Operations: metrics, logs, `rlproxy status`, progress bars and the dashboard.

Reads what components report (their typed stats and health); imports none of them.
"""
