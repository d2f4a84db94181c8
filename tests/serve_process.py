"""`rlproxy serve` as a real subprocess, for the tests that kill, signal or starve it: a free
port, a clean environment (no RLPROXY_* from the caller's shell but the model cache), and a wait
until /healthz answers that fails with the server's log when it exits or hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(*python_path: str | Path) -> dict:
    """The caller's environment without its RLPROXY_* settings (the model cache stays), output
    unbuffered, crashes traced, and PYTHON_PATH's folders (reward modules) importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RLPROXY_") or k == "RLPROXY_CACHE_DIR"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash (SIGSEGV, SIGABRT) prints every thread's stack
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, python_path), env.get("PYTHONPATH", "")])
    return env


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 120,
                 ok_only: bool = True) -> None:
    """Until /healthz answers (200, or any answer when not OK_ONLY); the log on failure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if requests.get(url + "/healthz", timeout=2).status_code == 200 or not ok_only:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"server did not answer in {timeout_s:g} s:\n{log_path.read_text()}")
