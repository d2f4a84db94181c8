"""Helpers for tests under `mlx.launch --backend ring` on this machine: a launch of `rlproxy`
(its ring's ports from rlproxy/ops/served.py, as its wait until healthy), the launched ranks'
processes, and a served launch to send turns to."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from rlproxy.ops.served import free_port, free_ports, wait_healthy

TESTS = Path(__file__).resolve().parent
LAUNCH = shutil.which("mlx.launch")


def launch(args: list[str], ranks: int = 2, **popen) -> subprocess.Popen:
    """`mlx.launch --backend ring -n RANKS -- python -m rlproxy.cli ARGS`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen(
        [LAUNCH, "--backend", "ring", "-n", str(ranks), "--starting-port",
         str(free_ports(ranks)), "--", sys.executable, "-m", "rlproxy.cli", *args],
        env=env, **popen)


SERVE = ["serve", "--model", "tiny", "--no-judge", "--no-at-least-one", "--reward-function",
         "test_trainer:target_reward", "--batch-size", "4", "--learning-rate", "1e-3",
         "--train-seed", "0", "--eval-every", "0", "--log-level", "INFO"]


def children(pid: int) -> list[int]:
    """PID's child processes (mlx.launch starts each rank from a thread of its own)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
            for c in (task / "children").read_text().split()]


def rank_pid(launcher: int, rank: int) -> int:
    """The process mlx.launch started as RANK (its launch script execs the command)."""
    for pid in children(launcher):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"MLX_RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


class Served:
    """`rlproxy serve` on RANKS ranks (mlx.launch) or in one plain process, until stopped with
    SIGINT to rank 0 (rank 0 then tells the others to stop)."""

    def __init__(self, data: Path, ranks: int, *extra: str):
        self.port = free_port()
        args = [*SERVE, "--data-dir", str(data), "--port", str(self.port), *extra]
        self.log = (data.parent / f"{data.name}.out").open("w")
        if ranks > 1:
            self.proc = launch(args, ranks, stdout=self.log, stderr=subprocess.STDOUT)
        else:
            env = {**os.environ, "PYTHONPATH": str(TESTS)}
            self.proc = subprocess.Popen([sys.executable, "-m", "rlproxy.cli", *args], env=env,
                                         stdout=self.log, stderr=subprocess.STDOUT)
        self.ranks, self.url = ranks, f"http://127.0.0.1:{self.port}"
        wait_healthy(self.proc, self.url, Path(self.log.name), timeout_s=180)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def rank(self, r: int) -> int:
        return rank_pid(self.proc.pid, r) if self.ranks > 1 else self.proc.pid

    def health(self) -> dict:
        return requests.get(self.url + "/healthz", timeout=10).json()

    def chat(self, text: str, seed: int, session: str | None = None, **kw) -> dict:
        headers = {"X-Session-Id": session, "X-Session-Done": "1"} if session else {}
        r = requests.post(self.url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 10,
            "seed": seed, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def turns(self, first: int, n: int = 4) -> None:
        for i in range(first, first + n):
            self.chat(f"hello {i}", seed=i, session=f"s-{i}")

    def wait(self, what, timeout: float = 180) -> dict:
        deadline = time.time() + timeout
        while not what(h := self.health()):
            assert time.time() < deadline, (h, self.output()[-3000:])
            time.sleep(0.3)
        return h

    def stop(self, sig: int = signal.SIGINT) -> str:
        if self.proc.poll() is None:
            try:
                os.kill(self.rank(0), sig)
            except (AssertionError, ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in children(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return Path(self.log.name).read_text()
