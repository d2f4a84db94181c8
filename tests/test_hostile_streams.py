"""Hostile and ending streams (issue 24, rows 3 and 7), on a real `rlproxy serve` process.

Row 3: clients that open a streamed request and never read it (raw sockets with a tiny
SO_RCVBUF, EOS banned so the answer never ends) are cut off: their generation stops, the batch
they filled frees for a normal request, memory stays flat, and their turns are not recorded
(as for any client that went away). A reader that falls behind and then catches up gets the
`client_stalled` error chunk and `[DONE]`.

Row 7: SIGTERM with a dozen requests in flight in all three dialects: short ones complete within
the drain, long ones end with their API's error event ([DONE] for Chat) or a 503, the process
exits 0, and every acknowledged turn is a whole line of conversations.jsonl.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from rlproxy.ops.served import free_port, server_env, wait_healthy
from conftest import ServerThread, make_settings, read_records

REPO = Path(__file__).resolve().parents[1]
BAN_EOS = {"0": -100, "2": -100}  # the tiny model's end tokens
PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]


class Serve:
    """`rlproxy serve --model tiny` as a subprocess, its log in DATA/server.log."""

    def __init__(self, data: Path, *flags: str):
        self.data, self.port = data, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = server_env()
        self.log = data / "server.log"
        data.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlproxy.cli", "serve", "--model", "tiny", "--port",
             str(self.port), "--data-dir", str(data), "--no-judge", "--log-level", "INFO",
             *flags], cwd=REPO, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, self.log)

    def engine(self) -> dict:
        return requests.get(self.url + "/healthz", timeout=10).json()["engine"]

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def wait_active(self, cond, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.engine()["active"]
            if cond(active) or time.monotonic() > deadline:
                return active
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(*flags: str) -> Serve:
        started.append(Serve(tmp_path / "data", *flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def stalled_reader(port: int, path: str = "/v1/chat/completions", **extra) -> socket.socket:
    """A streamed request that never ends, from a client that does not read its answer."""
    body = json.dumps({"model": "m", "messages": PROMPT, "max_tokens": 100_000, "stream": True,
                       "logit_bias": BAN_EOS, **extra}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
    return s


def read_to_end(s: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the server sent, and whether the connection then ended (EOF or reset)."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        return data, False
    return data, True


def test_stalled_readers_are_cut_off_and_never_hold_the_batch(serve):
    srv = serve("--stall-timeout-s", "2", "--max-batch", "16")
    rss_before = srv.rss_mb()
    socks = [stalled_reader(srv.port) for _ in range(16)]
    assert srv.wait_active(lambda a: a == 16, 20) == 16  # they fill the batch
    t0 = time.monotonic()
    r = requests.post(srv.url + "/v1/chat/completions", json={
        "model": "m", "messages": PROMPT, "max_tokens": 16}, timeout=60)
    answered_s = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert answered_s < 15, f"a 16-token request waited {answered_s:.1f} s behind stalled readers"
    assert srv.wait_active(lambda a: a == 0, 20) == 0  # every stalled generation stopped
    tokens = srv.engine()["tokens"]
    rss_cut = srv.rss_mb()
    time.sleep(3)
    assert srv.engine()["tokens"] == tokens  # nothing decodes for them any more
    assert srv.rss_mb() - rss_cut < 10 and rss_cut - rss_before < 150
    for s in socks:  # the server hung up on each, after what fit in the buffers
        data, ended = read_to_end(s, 15)
        assert ended and data.startswith(b"HTTP/1.1 200") and b"[DONE]" not in data
        s.close()
    log = srv.log.read_text()
    assert log.count("client_stalled") == 16, log[-3000:]
    metrics = requests.get(srv.url + "/metrics", timeout=10).text
    assert 'rlproxy_client_stalled_total{api="chat"} 16.0' in metrics, metrics[-2000:]
    # A client that went away is not recorded: only the normal request's turn is.
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=60) == 0
    records = read_records(srv.data) + read_records(srv.data, "pending_turns.jsonl")
    assert sum(1 for x in records if x.get("choices")) == 1


def test_a_reader_that_falls_behind_then_reads_gets_client_stalled(tiny, tmp_path):
    """More than completions.MAX_BACKLOG steps unread: the engine stops the sequence at once
    (well before --stall-timeout-s), and the stream ends with an error chunk, then [DONE]."""
    with ServerThread(make_settings(tmp_path, stall_timeout_s=60), tiny) as srv:
        port = srv.port
        s = stalled_reader(port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # started, then stopped while nobody read
            time.sleep(0.2)
            health = requests.get(srv.url + "/healthz", timeout=10).json()["engine"]
            if health["tokens"] > 0 and health["active"] == 0:
                break
        assert health["active"] == 0, health
        data, ended = read_to_end(s, 10)
        s.close()
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "client_stalled"
    assert 100 < len(events) < 2000  # the stream got what was decoded, then stopped


def post(url: str, path: str, body: dict, sid: str, out: dict) -> None:
    """A request read to its end (or its failure) into OUT[sid]."""
    try:
        r = requests.post(url + path, json=body, timeout=120, stream=body.get("stream", False),
                          headers={"X-Session-Id": sid, "X-Session-Done": "1",
                                   "anthropic-version": "2023-06-01"})
        out[sid] = {"status": r.status_code, "headers": dict(r.headers),
                    "text": r.content.decode()}
    except requests.RequestException as e:
        out[sid] = {"error": repr(e)}


def body_for(path: str, stream: bool, long: bool) -> dict:
    # Greedy, the tiny model writes no end token for this prompt (3,000 tokens checked);
    # logit_bias, where the API has it, makes sure.
    body = {"model": "m", "stream": stream, "temperature": 0}
    tokens = 100_000 if long else 60
    if path == "/v1/responses":
        return {**body, "input": PROMPT, "max_output_tokens": tokens}
    if path == "/v1/messages":
        return {**body, "messages": PROMPT, "max_tokens": tokens}
    return {**body, "messages": PROMPT, "max_tokens": tokens, "logit_bias": BAN_EOS}


def test_sigterm_drains_then_ends_what_is_left_and_exits_0(serve):
    srv = serve("--drain-timeout-s", "6")
    paths = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
    plan = {f"{kind}-{p.split('/')[-1]}-{'s' if stream else 'b'}": (p, stream, kind == "long")
            for kind in ("short", "long") for p in paths for stream in (True, False)}
    out: dict = {}
    threads = [threading.Thread(target=post, args=(srv.url, p, body_for(p, stream, long),
                                                    sid, out))
               for sid, (p, stream, long) in plan.items()]
    for t in threads:
        t.start()
    assert srv.wait_active(lambda a: a == len(plan), 30) == len(plan)  # all 12 in flight
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(requests.ConnectionError):  # the listening socket is closed
        requests.get(srv.url + "/healthz", timeout=2)
    assert srv.proc.wait(timeout=60) == 0
    for t in threads:
        t.join(timeout=30)
    for sid, (path, stream, long) in plan.items():
        got = out[sid]
        assert "error" not in got, (sid, got)
        text = got["text"]
        if not long:  # finished within the drain, whole
            assert got["status"] == 200, (sid, got)
            if stream:
                assert text.rstrip().endswith({"completions": "data: [DONE]",
                                               "responses": "}",
                                               "messages": '{"type":"message_stop"}'}[
                    path.split("/")[-1]]), (sid, text[-300:])
                if path == "/v1/responses":  # 60 tokens of 60: incomplete, and whole
                    last = json.loads(text.rstrip().split("\n")[-1][6:])
                    assert last["type"] == "response.incomplete", text[-300:]
            continue
        if not stream:  # still waiting when the drain ran out: 503 in its API's shape
            assert got["status"] == 503 and got["headers"].get("Retry-After"), (sid, got)
            err = json.loads(text)
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["type"] == "api_error"
            else:
                assert err["error"]["code"] == "server_shutting_down"
            continue
        assert got["status"] == 200
        if path == "/v1/chat/completions":
            last = [x for x in text.split("\n") if x.startswith("data: ")][-2:]
            assert last[1] == "data: [DONE]", text[-300:]
            assert json.loads(last[0][6:])["error"]["code"] == "server_shutting_down"
        elif path == "/v1/responses":
            failed = json.loads(text.rstrip().split("\n")[-1][6:])
            assert failed["type"] == "response.failed", text[-300:]
            assert failed["response"]["error"]["code"] == "server_shutting_down"
        else:
            assert text.rstrip().split("\n")[-2] == "event: error", text[-300:]
            err = json.loads(text.rstrip().split("\n")[-1][6:])
            assert err["type"] == "error" and err["error"]["type"] == "api_error"
    lines = (srv.data / "conversations.jsonl").read_text().split("\n")
    assert lines[-1] == ""  # whole lines only
    turns = [json.loads(x) for x in lines[:-1] if x]
    filed = sorted(t["session_id"] for t in turns if t.get("choices"))
    assert filed == sorted(sid for sid, (_, _, long) in plan.items() if not long)
    assert "drain ran out" in srv.log.read_text()
