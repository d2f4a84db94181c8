"""deploy/nginx.conf as shipped, run by Debian's nginx in front of real rlproxy processes: two
replicas (`--tinker-max-models 0`, so /api/v1 is not theirs) and a learner (the Tinker API on).

The routing part of the file runs byte for byte; only the lines marked `# @replica`,
`# @learner` and `# @listen` get this machine's ports. Checks that a session (X-Session-Id, Claude
Code's X-Claude-Code-Session-Id, or an id in a /v1/sessions/ID path) always reaches one replica,
that sessions spread over both, that a header-less client sticks to one replica, that SSE events
pass through one by one, that /api/v1/ reaches the learner, and that nginx's body limit is
rlproxy's. Skipped where there is no nginx (.ci/run installs Debian's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from rlproxy.ops.served import Served, free_port, stop

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "deploy" / "nginx.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)

pytestmark = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary on PATH or in /usr/sbin: install Debian's "
    "(`apt-get install nginx`, as .ci/run does) to test deploy/nginx.conf")

MARKED = re.compile(r"^([ \t]*)(server|listen) \S+;(\s*# @(replica|learner|listen))$", re.M)


def render(conf: str, replicas: list[str], learner: str, listen: int) -> str:
    """CONF with its marked addresses replaced, in order; every other byte kept."""
    given = {"replica": replicas, "learner": [learner], "listen": [str(listen)]}
    marked = [m[4] for m in MARKED.finditer(conf)]
    assert sorted(marked) == sorted(k for k, v in given.items() for _ in v), \
        f"deploy/nginx.conf marks {marked}, the test fills {given}"
    left = {k: iter(v) for k, v in given.items()}
    return MARKED.sub(lambda m: f"{m[1]}{m[2]} {next(left[m[4]])};{m[3]}", conf)


# nginx's own settings around the shipped http-context file, as the nginx image's nginx.conf is
MAIN_CONF = """worker_processes 1;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {routing};
}}
"""


def start_rlproxy(data: Path, *flags: str) -> Served:
    """A replica or the learner, started (its log: DATA.log); the caller waits for it."""
    return Served(data, "--log-level", "WARNING", "--no-train", "--no-judge", *flags,
                  wait_s=None)


def wait_port(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nginx exited with {proc.returncode}:\n{log.read_text()}")
        try:
            requests.get(url + "/nginx-test-probe", timeout=2)
            return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f"nginx did not answer in {timeout_s:g} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def stack():
    # nginx's workers run as `nobody` when the tests run as root: a folder they can enter
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-nginx-"))
    tmp.chmod(0o755)
    procs, servers = [], []
    try:
        for name, flags in (("replica1", ["--tinker-max-models", "0"]),
                            ("replica2", ["--tinker-max-models", "0"]), ("learner", [])):
            servers.append(start_rlproxy(tmp / name, *flags))
            procs.append(servers[-1].proc)
        for server in servers:
            server.wait_healthy(timeout_s=90)
        replicas, learner = [s.url for s in servers[:2]], servers[2].url
        listen = free_port()
        routing = tmp / "rlproxy.conf"
        routing.write_text(render(CONF.read_text(), [u.removeprefix("http://") for u in replicas],
                                  learner.removeprefix("http://"), listen))
        main = tmp / "nginx.conf"
        main.write_text(MAIN_CONF.format(tmp=tmp, routing=routing))
        log = tmp / "nginx.log"
        with open(log, "wb") as out:
            nginx = subprocess.Popen(
                [NGINX, "-p", str(tmp), "-c", str(main), "-e", "stderr",
                 "-g", f"daemon off; pid {tmp}/nginx.pid;"],
                stdout=out, stderr=subprocess.STDOUT)
        procs.append(nginx)
        url = f"http://127.0.0.1:{listen}"
        wait_port(nginx, url, log)
        yield {"url": url, "replicas": replicas, "learner": learner}
    finally:
        for proc in reversed(procs):
            stop(proc, timeout_s=10)
        shutil.rmtree(tmp, ignore_errors=True)


def chat(url: str, messages: list[dict], headers: dict | None = None, **extra) -> dict:
    r = requests.post(url + "/v1/chat/completions", headers=headers or {}, timeout=60, json={
        "model": "m", "messages": messages, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def sessions_on(replica: str) -> dict[str, dict]:
    r = requests.get(replica + "/v1/sessions", timeout=10)
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["data"]}


def test_each_session_stays_on_one_replica_and_sessions_spread(stack):
    url = stack["url"]

    def two_turns(i: int) -> None:
        sid = f"nginx-{i}"
        chat(url, [{"role": "user", "content": f"task {i}"}], {"X-Session-Id": sid})
        if i % 2:  # Claude Code names its session in its own header, on the Messages API
            r = requests.post(url + "/v1/messages", timeout=60,
                              headers={"X-Claude-Code-Session-Id": sid}, json={
                                  "model": "m", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": f"task {i}, again"}]})
            assert r.status_code == 200, r.text
        else:
            chat(url, [{"role": "user", "content": f"task {i}, again"}], {"X-Session-Id": sid})

    n = 24
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(two_turns, range(n)))

    seen = [sessions_on(r) for r in stack["replicas"]]
    for i in range(n):
        sid = f"nginx-{i}"
        where = [k for k, s in enumerate(seen) if sid in s]
        assert len(where) == 1, f"session {sid} is on replicas {where}"
        assert seen[where[0]][sid]["turns"] == 2, seen[where[0]][sid]
        # a request about the session (its id in the path) reaches the replica that has it
        r = requests.get(f"{url}/v1/sessions/{sid}", timeout=10)
        assert r.status_code == 200, r.text
    counts = [sum(sid.startswith("nginx-") for sid in s) for s in seen]
    assert all(counts), f"sessions per replica: {counts} (one replica got none)"


def test_a_client_without_a_session_header_sticks_to_one_replica(stack):
    """Header-less agents: rlproxy links their turns by prefix, within one process only. Each
    client's second turn must reach the replica that has its first, or it opens a new session."""
    clients = [{"Authorization": f"Bearer key-{k}"} for k in range(5)]
    clients += [{"x-api-key": "anthropic-style"}, {}]  # and one with no credential at all
    before = [{sid for sid, s in sessions_on(r).items() if s["inferred"]}
              for r in stack["replicas"]]
    url = stack["url"]
    for k, headers in enumerate(clients):
        first = [{"role": "user", "content": f"client {k} asks a question"}]
        reply = chat(url, first, headers)["choices"][0]["message"]
        assistant = {"role": "assistant", "content": reply.get("content") or ""}
        chat(url, [*first, assistant, {"role": "user", "content": "and a follow-up"}], headers)
    new = [s for r, old in zip(stack["replicas"], before)
           for sid, s in sessions_on(r).items() if s["inferred"] and sid not in old]
    assert sorted(s["turns"] for s in new) == [2] * len(clients), new


def test_a_stream_arrives_event_by_event(stack):
    t0 = time.monotonic()
    r = requests.post(stack["url"] + "/v1/chat/completions", stream=True, timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 200, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    arrivals = [time.monotonic() - t0 for line in r.iter_lines() if line.startswith(b"data:")]
    end = arrivals[-1]
    assert len(arrivals) > 20, arrivals
    # buffered, every event would arrive at the end together
    assert arrivals[1] < end / 2, f"first delta at {arrivals[1]:.3f} s of {end:.3f} s"
    spread = len({round(t, 3) for t in arrivals})
    assert spread > len(arrivals) / 4, f"events arrived at only {spread} distinct milliseconds"


def test_the_tinker_api_goes_to_the_learner(stack):
    for replica in stack["replicas"]:  # not theirs: --tinker-max-models 0
        assert requests.get(replica + "/api/v1/healthz", timeout=10).status_code == 404
    r = requests.get(stack["url"] + "/api/v1/healthz", timeout=10)
    assert (r.status_code, r.json()) == (200, {"status": "ok"}), r.text
    r = requests.get(stack["url"] + "/api/v1/get_server_capabilities", timeout=10)
    assert r.status_code == 200 and r.json()["supported_models"], r.text


def test_the_body_limit_is_rlproxys(stack):
    """nginx's client_max_body_size is rlproxy's --max-request-mb default, 32 MiB: a body at it
    reaches a replica (which finds it is no JSON), one byte more is nginx's own 413."""
    limit = 32 * 1024 * 1024
    url = stack["url"] + "/v1/chat/completions"
    headers = {"Content-Type": "application/json", "X-Session-Id": "big-body"}
    r = requests.post(url, data=b"x" * limit, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"], r.text[:300]
    r = requests.post(url, data=b"x" * (limit + 1), headers=headers, timeout=60)
    assert r.status_code == 413 and "nginx" in r.text, r.text[:300]
