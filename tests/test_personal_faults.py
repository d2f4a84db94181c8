"""Personal adapters under faults: `rlproxy serve` as a subprocess, SIGKILLed inside a training
step of one adapter, then started again on the same data dir with another adapter's newest
checkpoint damaged. Nothing any adapter acknowledged is lost, the killed step's turn trains on
the retry, and the damaged checkpoint is set aside while every adapter starts."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from rlproxy import paths
from rlproxy.ops.served import free_port, server_env, wait_healthy
from rlproxy.records import read_jsonl
from test_durability import stop
from test_poison import COMMON, REPO, REWARD_MODULE, journal, kill_inside, trained_uids

pytestmark = pytest.mark.slow  # two servers, a step over a ~3,500-token turn killed

LONG_WORDS = 3500  # a step over it with --prompt-grad full takes seconds: killed inside


def serve(data: Path, tmp: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlproxy.cli", "serve", "--model", "tiny", "--port",
             str(port), "--data-dir", str(data), "--log-level", "WARNING", "--batch-size", "1",
             "--no-judge", "--no-at-least-one", "--reward-function", "poison_reward:reward",
             "--baseline", "none", "--save-interval", "1", "--no-prefix-cache",
             "--prompt-grad", "full"],
            cwd=REPO, env=server_env(tmp, REPO), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, ok_only=False)
    return proc, url


def chat(url: str, adapter: str | None, sid: str, content: str, done: bool = True) -> str:
    """One turn (its session done unless DONE is false); its uid."""
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "1"} if done else {}),
               **({"X-RL-Adapter": adapter} if adapter else {})}
    raw = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) \
        .chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=8, seed=1,
            extra_headers=headers)
    assert raw.headers["X-RL-Adapter" if adapter else "X-Session-Id"] == (adapter or sid)
    return raw.headers["X-Turn-Uid"]


def folder(data: Path, adapter: str | None) -> Path:
    return data / paths.ADAPTERS / adapter if adapter else data


def wait_trained(data: Path, uid: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while uid not in trained_uids(data):
        assert time.monotonic() < deadline, (data, uid, journal(data))
        time.sleep(0.1)


def recorded(data: Path) -> set[str]:
    """Uids of the turns in a folder's records: finished, or pending their next state."""
    done = {ln["uid"] for ln in read_jsonl(data / paths.CONVERSATIONS)}
    pending = [e for e in read_jsonl(data / paths.PENDING)] if (data / paths.PENDING).exists() \
        else []
    gone = {e["uid"] for e in pending if e.get("kind") == "done"}
    return done | {e["uid"] for e in pending if e.get("kind") == "turn"} - gone


def test_a_kill_in_one_adapters_step_and_a_damaged_checkpoint_of_another_lose_nothing(
        tmp_path):
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    data, log = tmp_path / "data", tmp_path / "server.log"
    long_text = " ".join(random.Random(0).choice(COMMON) for _ in range(LONG_WORDS))
    acked: dict[str | None, list[str]] = {None: [], "alice": [], "bob": []}
    proc, url = serve(data, tmp_path, log)
    try:
        for adapter in (None, "bob"):
            acked[adapter].append(chat(url, adapter, f"{adapter}-1", "hello there"))
            wait_trained(folder(data, adapter), acked[adapter][-1])
        acked["bob"].append(chat(url, "bob", "bob-open", "still working", done=False))
        acked["alice"].append(chat(url, "alice", "alice-long", long_text))
        alice = folder(data, "alice")
        deadline = time.monotonic() + 60
        while not (starts := [ln for ln in journal(alice) if ln["kind"] == "step_start"]):
            assert time.monotonic() < deadline, journal(alice)
            time.sleep(0.01)
        kill_inside(proc, alice, starts[0])
    finally:
        stop(proc)

    bob_ckpt = paths.kept_checkpoint(folder(data, "bob") / paths.CHECKPOINTS, 1)
    (bob_ckpt / "adapters.safetensors").write_bytes(b"garbage" * 100)
    before = log.read_text()
    proc, url = serve(data, tmp_path, log)
    try:
        h = requests.get(url + "/healthz", timeout=10).json()
        assert h["status"] == "ok" and h["adapters"]["resting"] == ["alice", "bob"], h
        acked["alice"].append(chat(url, "alice", "alice-2", "after the restart"))  # back
        wait_trained(alice, acked["alice"][0])  # the killed step's turn, on its retry
        open_session = requests.get(url + "/v1/sessions/bob-open",  # brings bob back
                                    headers={"X-RL-Adapter": "bob"}, timeout=10)
        acked["bob"].append(chat(url, "bob", "bob-2", "after the restart"))
        h = requests.get(url + "/healthz", timeout=10).json()
        assert set(h["adapters"]["adapters"]) == {"alice", "bob"} and h["status"] == "ok", h
        acked[None].append(chat(url, None, "default-2", "after the restart"))
    finally:
        stop(proc)
    text = log.read_text()[len(before):]
    assert "Traceback" not in text, text
    assert any(f"{bob_ckpt} cannot be read" in ln for ln in text.splitlines()
               if " WARNING " in ln), text
    assert list(bob_ckpt.parent.glob(f"{bob_ckpt.name}.corrupt-*"))
    assert open_session.status_code == 200 and not open_session.json()["closed"]
    for adapter, uids in acked.items():  # every acknowledged turn, in its own adapter's files
        mine, others = recorded(folder(data, adapter)), set().union(*(
            recorded(folder(data, a)) for a in acked if a != adapter))
        assert set(uids) <= mine and not set(uids) & others, (adapter, uids)
    assert [ln for ln in journal(alice) if ln["kind"] == "step_end" and ln.get("died")]
