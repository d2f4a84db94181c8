"""Helpers for tests that need a server which trains: the demo's scripted agent drives it over
real HTTP, and the demo's verifiable reward scores it (no judge)."""

from __future__ import annotations

import asyncio
import time

import requests
from aiohttp import ClientSession, ClientTimeout

from rlproxy.demo import run as demo
from conftest import make_settings


def training_settings(tmp_path, **flags):
    """Train a step per session (2 turns), checkpoint every step, keep them all. Baseline none:
    the tiny model's replies often score alike, and a batch of zero advantages takes no step,
    while these tests count steps."""
    return make_settings(tmp_path, train=True, judge=False, at_least_one=False,
                         reward_functions=[demo.REWARD_FUNCTION], batch_size=2, baseline="none",
                         learning_rate=1e-3, save_interval=1, keep_checkpoints=50, fsync=False,
                         resume=False, **flags)


def run_sessions(url: str, first: int, count: int) -> None:
    """COUNT demo sessions (two turns each, the last marked done), one after another."""
    async def go():
        async with ClientSession(url, timeout=ClientTimeout(total=300)) as http:
            for i in range(first, first + count):
                await demo.run_session(http, f"demo-{i:05d}", i)

    asyncio.run(go())


def wait_for_steps(url: str, steps: int, timeout_s: float = 300.0, headers=None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = requests.get(url + "/healthz", headers=headers).json()
        assert not h["trainer"].get("error"), h["trainer"]
        if h["trainer"]["step"] >= steps:
            return h
        assert time.monotonic() < deadline, f"the trainer is at {h['trainer']}"
        time.sleep(0.2)
