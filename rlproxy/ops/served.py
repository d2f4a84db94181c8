"""`rlproxy serve` as a subprocess, for the tests and benchmarks that run the real server from
outside (to kill it, signal it, starve it or time it): a free port, a clean environment, a wait
until /healthz answers that fails with the server's log when it exits or hangs, /healthz itself,
freeze and thaw (SIGSTOP/SIGCONT), and a stop.

    with Served(tmp / "data", "--no-train", "--no-judge") as server:
        requests.post(server.url + "/v1/chat/completions", json=...)

Knows nothing of the server's internals: it starts `python -m rlproxy.cli serve FLAGS` and speaks
HTTP, with the standard library only, so tests/ and bench/ import it alike (the installed
package is what both already import). The in-process server is not here: that is the tests'
`ServerThread` (tests/conftest.py) and bench/common.py's `start_server`.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # the server runs from here: this code, not another
LOG_TAIL = 20_000  # characters of the server's log an error shows
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy


def free_port() -> int:
    """A port free on 127.0.0.1 now, that nothing else is handed meanwhile (`free_ports`)."""
    return free_ports(1)


def free_ports(n: int) -> int:
    """A port P with P .. P+N-1 free on 127.0.0.1 now (mlx.launch's ring backend listens on one
    per rank), drawn at random from below the range the OS hands out for port 0 and outgoing
    connections. A port the OS picked could go to any other connection before the caller's
    server binds it (the ring once failed with "Couldn't bind socket" in the suite); one below
    that range is taken only by another caller that drew the same number."""
    low, high = _ephemeral_range()
    first, last = (10_000, low - n) if low - n > 10_000 else (high + 1, 65_536 - n)
    for _ in range(200):
        base = _PICK.randrange(first, last)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


_PICK = random.Random()  # its own state: a test that seeds `random` must not fix the ports


def _ephemeral_range() -> tuple[int, int]:
    """Linux's ip_local_port_range; elsewhere 49152-65535 (macOS, the IANA range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def server_env(*python_path: str | Path, **extra: str) -> dict:
    """The caller's environment without its RLPROXY_* settings (the model cache,
    RLPROXY_CACHE_DIR, stays), output unbuffered, crashes traced, PYTHON_PATH's folders (reward
    modules, another checkout) first on the path, and EXTRA on top."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RLPROXY_") or k == "RLPROXY_CACHE_DIR"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash (SIGSEGV, SIGABRT) prints every thread's stack
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, python_path), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def serve_command(*flags: str, port: int, data_dir: str | Path | None = None,
                  model: str = "tiny") -> list[str]:
    """`python -m rlproxy.cli serve --model MODEL --port PORT [--data-dir DATA_DIR] FLAGS`."""
    where = ["--data-dir", str(data_dir)] if data_dir is not None else []
    return [sys.executable, "-m", "rlproxy.cli", "serve", "--model", model, "--port", str(port),
            *where, *flags]


def health(url: str, timeout_s: float = 10) -> dict | None:
    """URL's /healthz: its JSON when the server answers (200, or 503 and what is wrong), None
    while nothing does (starting, gone, or frozen past the timeout)."""
    try:
        with _DIRECT.open(url + "/healthz", timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def healthz_status(url: str, timeout_s: float = 2) -> int | None:
    """The status /healthz answers with, or None while nothing answers."""
    try:
        with _DIRECT.open(url + "/healthz", timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def log_tail(log: Path) -> str:
    try:
        return Path(log).read_text(errors="replace")[-LOG_TAIL:]
    except OSError as e:
        return f"(no log: {e})"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 120,
                 ok_only: bool = True) -> None:
    """Until /healthz answers 200 (any answer when not OK_ONLY). A server that exits first is
    an error with its log; one that does not answer in time is killed, then the same."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_tail(log)}")
        status = healthz_status(url)
        if status == 200 or (status is not None and not ok_only):
            return
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server did not answer in {timeout_s:g} s:\n{log_tail(log)}")


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> int | None:
    """SIGTERM (the server drains, then exits), SIGKILL if it is still there after TIMEOUT_S;
    its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Served:
    """One `rlproxy serve` subprocess on a free port (or PORT), its output appended to LOG
    (default: beside DATA_DIR, as DATA_DIR.log). It is healthy when the constructor returns,
    unless WAIT_S is None (then call `wait_healthy`).

    DATA_DIR None: the server's default data dir (~/.rlproxy/MODEL under HOME). ENV goes on top
    of `server_env(*PYTHON_PATH)`. MEMORY_GB caps its address space (a runaway step kills the
    server, not a shared machine); WRAP runs it under a command (`taskset -c 1`); CWD is the
    checkout whose code runs."""

    def __init__(self, data_dir: str | Path | None, *flags: str, model: str = "tiny",
                 port: int | None = None, log: str | Path | None = None, env: dict | None = None,
                 python_path: tuple = (), cwd: str | Path = CHECKOUT,
                 memory_gb: float | None = None, wrap: tuple = (),
                 wait_s: float | None = 120, ok_only: bool = True):
        if log is None and data_dir is None:
            raise ValueError("a server on its default data dir needs a log path")
        self.data_dir = Path(data_dir).absolute() if data_dir is not None else None
        self.log = Path(log).absolute() if log is not None else \
            self.data_dir.with_name(self.data_dir.name + ".log")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*wrap, *serve_command(*flags, port=self.port, data_dir=self.data_dir,
                                               model=model)]
        limit = None if memory_gb is None else int(memory_gb * 2**30)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command, cwd=cwd, env=server_env(*python_path, **(env or {})), stdout=out,
                stderr=subprocess.STDOUT, preexec_fn=None if limit is None else
                lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
        self.frozen_at: float | None = None  # time.time() of the SIGSTOP in force
        self.freezes: list[tuple[float, float]] = []  # (stopped, continued), time.time()
        if wait_s is not None:
            try:
                self.wait_healthy(wait_s, ok_only)
            except BaseException:
                self.proc.kill()
                self.proc.wait()
                raise

    def wait_healthy(self, timeout_s: float = 120, ok_only: bool = True) -> None:
        wait_healthy(self.proc, self.url, self.log, timeout_s, ok_only)

    def health(self, timeout_s: float = 10) -> dict | None:
        return health(self.url, timeout_s)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def freeze(self) -> None:
        """SIGSTOP: nothing in the server moves (no request, step or write) until `thaw`."""
        if self.frozen_at is None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen_at = time.time()

    def thaw(self) -> None:
        if self.frozen_at is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.freezes.append((self.frozen_at, time.time()))
            self.frozen_at = None

    def stop(self, timeout_s: float = 60) -> int | None:
        """Thawed, then `stop`: its exit code."""
        self.thaw()
        return stop(self.proc, timeout_s)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
