"""rlproxy/ops/served.py's ports: drawn outside the range the OS hands out on its own, so no
connection or bind(0) elsewhere takes one between the draw and the server binding it."""

from __future__ import annotations

import socket

from rlproxy.ops import served


def test_free_ports_are_bindable_runs_outside_the_ephemeral_range(monkeypatch):
    low, high = served._ephemeral_range()
    for _ in range(20):
        base = served.free_ports(4)
        assert not low <= base <= high and not low <= base + 3 <= high, (base, low, high)
        for p in range(base, base + 4):  # each still free: the caller's server can bind it
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    # a range that starts at or below 10000 leaves no room under it: above it instead
    monkeypatch.setattr(served, "_ephemeral_range", lambda: (1024, 40000))
    assert all(40000 < served.free_port() < 65536 for _ in range(20))
