"""A rollback to the oldest kept checkpoint while training saves (and prunes) at every step:
the checkpoint is found and pinned when the request comes, so no save between the request and
the trainer's load removes it. Every answer is 200, or a 404 `checkpoint_not_found` for a
step already gone when asked; never a 409 naming a file that vanished."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import requests
from aiohttp import ClientSession, ClientTimeout

from conftest import ServerThread, make_settings
from demo_agent import wait_for_steps
from rlproxy.demo import run as demo

pytestmark = pytest.mark.slow


def traffic(url: str, stop: threading.Event) -> None:
    """Demo sessions one after another until STOP: a training step (and a save) each."""
    async def go():
        async with ClientSession(url, timeout=ClientTimeout(total=300)) as http:
            i = 0
            while not stop.is_set():
                await demo.run_session(http, f"race-{i:05d}", i)
                i += 1

    asyncio.run(go())


def test_rollback_to_the_oldest_kept_checkpoint_while_every_step_saves(tmp_path):
    settings = make_settings(tmp_path, train=True, judge=False, at_least_one=False,
                             reward_functions=[demo.REWARD_FUNCTION], batch_size=2,
                             baseline="none", learning_rate=1e-3, save_interval=1,
                             keep_checkpoints=3, fsync=False, resume=False)
    root = tmp_path / "checkpoints"
    with ServerThread(settings) as s:
        stop = threading.Event()
        driver = threading.Thread(target=traffic, args=(s.url, stop), daemon=True)
        driver.start()
        try:
            wait_for_steps(s.url, 3)
            answers = []
            for _ in range(20):
                kept = sorted(p.name for p in root.glob("step_*"))
                oldest = int(kept[0].removeprefix("step_"))
                r = requests.post(f"{s.url}/v1/adapters/{oldest}/serve", timeout=300)
                answers.append(r.status_code)
                if r.status_code == 404:  # pruned between the listing and the request
                    assert r.json()["error"]["code"] == "checkpoint_not_found", r.text
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["checkpoint_step"] == oldest
                time.sleep(0.05)
        finally:
            stop.set()
            driver.join(timeout=300)
        health = requests.get(s.url + "/healthz").json()
    assert answers.count(200) >= 10, answers
    assert health["trainer"]["alive"] and not health["trainer"].get("error")
