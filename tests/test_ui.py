"""The dashboard and the operator's actions, on real servers: auth, the record index, rollback
(the served tokens equal the checkpoint's, loaded fresh with mlx-lm), pause/resume, and a real
browser (Debian's chromium driven by Playwright) loading the pages after the demo's agent ran."""

from __future__ import annotations

import io
import shutil
import time
import uuid
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import orjson
import pytest
import requests

from conftest import ServerThread, make_settings, read_records
from demo_agent import run_sessions, training_settings, wait_for_steps
from rlproxy.appkeys import MODEL
from rlproxy.ui.index import RecordIndex

KEY = "ui-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = "/usr/bin/chromium"
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


# ---- the index ----

def turn_line(uid: str, sid: str, index: int, received: float) -> bytes:
    return orjson.dumps({"kind": "turn", "uid": uid, "session_id": sid, "index": index,
                         "turn_type": "main", "prompt_ids": list(range(50)),
                         "messages": [{"role": "user", "content": "hi " * 20}],
                         "choices": [{"completion_ids": [1, 2, 3], "text": "ok",
                                      "tool_calls": [], "logprobs": [-1.0] * 3}],
                         "timings": {"received": received, "first_token_s": 0.01},
                         "next_state": [{"role": "user", "content": "next"}]}) + b"\n"


def test_the_index_reads_only_new_bytes_and_keeps_up_with_100k_turns(tmp_path):
    now = time.time()
    with open(tmp_path / "conversations.jsonl", "wb") as f:
        f.writelines(turn_line(f"u{i}", f"s{i // 10}", i % 10, now) for i in range(100_000))
    index = RecordIndex(tmp_path)
    tic = time.perf_counter()
    index.refresh()
    first = time.perf_counter() - tic
    assert len(index.turns) == 100_000 and len(index.sessions) == 10_000
    tic = time.perf_counter()
    index.refresh()  # nothing new: nothing read
    assert time.perf_counter() - tic < 0.01
    with open(tmp_path / "conversations.jsonl", "ab") as f:
        f.write(turn_line("new", "s5", 10, now))
        f.write(turn_line("torn", "s5", 11, now)[:40])  # a line still being written
    tic = time.perf_counter()
    index.refresh()
    again = time.perf_counter() - tic
    assert "new" in index.turns and "torn" not in index.turns
    assert again < 0.05, f"an append re-read the file ({again:.3f} s; first scan {first:.2f} s)"
    turns = index.session_turns("s5")
    assert [t["uid"] for t in turns][-1] == "new" and turns[0]["next_state"][0]["content"] == "next"
    assert index.today()["turns"] == 100_001


# ---- auth, on a server with a key (training off) ----

@pytest.fixture(scope="module")
def keyed(tiny, tmp_path_factory):
    with ServerThread(make_settings(tmp_path_factory.mktemp("data"), api_key=KEY), tiny) as s:
        yield s


def test_the_dashboard_and_the_actions_need_the_key(keyed):
    url = keyed.url
    page = requests.get(url + "/ui", allow_redirects=False)
    assert page.status_code == 302 and page.headers["Location"] == "/ui/login"
    for path in ("/ui/api/overview", "/ui/api/sessions", "/ui/api/adapters", "/ui/static/app.js"):
        assert requests.get(url + path).status_code == 401, path
    for path in ("/v1/adapters/1/serve", "/v1/training/pause", "/v1/training/resume",
                 "/ui/api/training/pause"):
        assert requests.post(url + path).status_code == 401, path
    assert requests.post(url + "/ui/login", data={"key": "wrong"},
                         allow_redirects=False).status_code == 401
    browser = requests.Session()
    signed = browser.post(url + "/ui/login", data={"key": KEY}, allow_redirects=False)
    assert signed.status_code == 302
    cookie = signed.cookies.get("rlproxy_api_key")
    assert cookie == KEY and "httponly" in signed.headers["Set-Cookie"].lower()
    assert browser.get(url + "/ui").status_code == 200
    assert browser.get(url + "/ui/api/overview").json()["trainer"] == {"enabled": False}
    assert browser.get(url + "/v1/models").status_code == 401  # the cookie is for /ui only
    # with the key: training is off here, and there is no checkpoint to serve
    assert requests.post(url + "/v1/training/pause", headers=AUTH).status_code == 409
    missing = requests.post(url + "/v1/adapters/7/serve", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
    assert requests.post(url + "/v1/adapters/x/serve", headers=AUTH).status_code == 400
    assert requests.get(url + "/ui/api/sessions/nope", headers=AUTH).status_code == 404
    assert requests.get(url + "/ui/api/sessions/nope?start=x", headers=AUTH).status_code == 400
    assert requests.get(url + "/ui/api/adapters/3.zip", headers=AUTH).status_code == 404


def test_pages_insert_recorded_text_as_text_only():
    static = Path(__file__).resolve().parent.parent / "rlproxy" / "ui" / "static"
    js = (static / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js, sink


# ---- a server that trains: rollback, pause, the browser ----

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    with ServerThread(training_settings(data)) as s:
        run_sessions(s.url, 0, 3)
        wait_for_steps(s.url, 3)
        s.data_dir = data
        yield s


def greedy(server, data_dir: Path) -> dict:
    """One greedy side turn (recorded at once, never trained): its record's chosen choice."""
    sid = f"greedy-{uuid.uuid4().hex[:8]}"
    server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        max_tokens=10, temperature=0,
        extra_headers={"X-Session-Id": sid, "X-Turn-Type": "side"})
    record = [r for r in read_records(data_dir) if r["session_id"] == sid][-1]
    return {"prompt_ids": record["prompt_ids"], **record["choices"][0]}


def fresh_greedy(source: str, checkpoint: Path, prompt_ids: list[int], n: int) -> list[int]:
    """N greedy tokens from the checkpoint loaded fresh by mlx-lm (no server code involved)."""
    model, _ = mlx_lm.load(source, adapter_path=str(checkpoint))
    ids, out = list(prompt_ids), []
    for _ in range(n):
        token = mx.argmax(model(mx.array(ids)[None])[0, -1]).item()
        out.append(token)
        ids.append(token)
    return out


def test_rollback_serves_the_checkpoint_and_training_continues_from_it(trained):
    url, data = trained.url, trained.data_dir
    before = requests.get(url + "/healthz").json()
    version, step = before["adapter_version"], before["trainer"]["step"]
    r = requests.post(url + "/v1/adapters/1/serve")
    assert r.status_code == 200, r.text
    line = r.json()
    assert line["checkpoint_step"] == 1 and line["adapter_version"] == version + 1
    assert requests.get(url + "/healthz").json()["adapter_version"] == version + 1
    served = greedy(trained, data)
    assert set(served["adapter_versions"]) == {version + 1}
    checkpoint = data / "checkpoints" / "step_000001"
    source = trained.app[MODEL].source
    assert served["completion_ids"] == fresh_greedy(source, checkpoint, served["prompt_ids"],
                                                    len(served["completion_ids"]))
    download = requests.get(url + "/ui/api/adapters/1.zip")
    assert download.headers["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(download.content)) as z:
        assert z.read("step_000001/adapters.safetensors") == (
            checkpoint / "adapters.safetensors").read_bytes()
    rollbacks = [ln for ln in read_records(data, "training.jsonl") if ln["kind"] == "rollback"]
    assert rollbacks[-1]["checkpoint_step"] == 1 and rollbacks[-1]["step"] == step + 1
    # the rollback is a checkpoint of its own (a restart resumes from it) ...
    saved = mx.load(str(data / "checkpoints" / f"step_{step + 1:06d}" / "adapters.safetensors"))
    original = mx.load(str(checkpoint / "adapters.safetensors"))
    assert all(mx.array_equal(saved[k], original[k]).item() for k in original)
    # ... and training goes on from it
    run_sessions(url, 100, 1)
    wait_for_steps(url, step + 2)
    last = [ln for ln in read_records(data, "training.jsonl") if ln["kind"] == "step"][-1]
    assert last["step"] == step + 2 and last["adapter_version"] == version + 2


def test_pause_holds_training_and_resume_lets_it_go_on(trained):
    url = trained.url
    step = requests.get(url + "/healthz").json()["trainer"]["step"]
    assert requests.post(url + "/v1/training/pause").json()["paused"] is True
    released = requests.get(url + "/healthz").json()["scoring"]["released"]
    run_sessions(url, 200, 1)
    deadline = time.monotonic() + 60
    while requests.get(url + "/healthz").json()["scoring"]["released"] < released + 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)  # a running trainer takes ~1 s for this step
    overview = requests.get(url + "/ui/api/overview").json()
    assert overview["trainer"]["paused"] is True and overview["trainer"]["step"] == step
    assert requests.post(url + "/v1/training/resume").json()["paused"] is False
    wait_for_steps(url, step + 1)
    kinds = [ln["kind"] for ln in read_records(trained.data_dir, "training.jsonl")]
    assert kinds[-3:] == ["pause", "resume", "step"]


def test_rollback_with_training_off_publishes_to_the_engine(trained, tmp_path):
    shutil.copytree(trained.data_dir / "checkpoints" / "step_000002",
                    tmp_path / "checkpoints" / "step_000002")
    with ServerThread(make_settings(tmp_path)) as s:
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 0
        r = requests.post(s.url + "/v1/adapters/2/serve")
        assert r.status_code == 200 and r.json()["adapter_version"] == 1
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 1
        served = greedy(s, tmp_path)
        assert served["completion_ids"] == fresh_greedy(
            s.app[MODEL].source, tmp_path / "checkpoints" / "step_000002", served["prompt_ids"],
            len(served["completion_ids"]))
        broken = tmp_path / "checkpoints" / "step_000009"  # complete-looking, unreadable
        shutil.copytree(tmp_path / "checkpoints" / "step_000002", broken)
        (broken / "adapters.safetensors").write_bytes(b"not safetensors")
        r = requests.post(s.url + "/v1/adapters/9/serve")
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_unusable"
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 1
    assert read_records(tmp_path, "training.jsonl")[-1]["kind"] == "rollback"


def test_the_dashboard_in_a_real_browser(trained, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    url = trained.url
    # a session whose recorded text is hostile: it must show up as text, and never run
    first = trained.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": XSS}], max_tokens=4,
        extra_headers={"X-Session-Id": "xss"})
    trained.client().chat.completions.create(
        model="m", max_tokens=4, extra_headers={"X-Session-Id": "xss", "X-Session-Done": "1"},
        messages=[{"role": "user", "content": XSS},
                  {"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": XSS}])
    wait_for_steps(url, requests.get(url + "/healthz").json()["trainer"]["step"] + 1)
    steps = [ln for ln in read_records(trained.data_dir, "training.jsonl") if ln["kind"] == "step"]
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/ui")
            page.wait_for_selector("#chart-reward")
            assert page.locator("#chart-reward circle.pt").count() == len(steps)
            assert page.locator("#counters .counter").count() >= 10
            page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)

            page.goto(url + "/ui#/session/demo-00000")
            page.wait_for_function("document.body.dataset.loaded === '#/session/demo-00000'")
            next_state = page.locator(".next-state").first.inner_text()
            assert "Thanks. What will it be tomorrow?" in next_state

            page.goto(url + "/ui#/session/xss")
            page.wait_for_function("document.body.dataset.loaded === '#/session/xss'")
            assert XSS in page.locator(".turn").first.inner_text()
            assert page.locator("#view script, #view img").count() == 0
            assert page.evaluate("window.__pwned === undefined")
            page.screenshot(path=str(tmp_path / "session.png"), full_page=True)

            page.goto(url + "/ui#/adapters")
            page.wait_for_function("document.body.dataset.loaded === '#/adapters'")
            assert page.get_by_text("serve this one").count() >= 3
            page.screenshot(path=str(tmp_path / "adapters.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert (tmp_path / "overview.png").stat().st_size > 10_000


def test_status_shows_one_screen(trained, capsys):
    import argparse

    from rlproxy.status import status_cmd

    assert status_cmd(argparse.Namespace(url=trained.url, api_key=None)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 24
    assert "model rlproxy-embedded-tiny" in lines[0] and "adapter v" in lines[0]
    assert any(ln.startswith("trainer   running; step") for ln in lines)
    assert any(ln.startswith("cache     hit rate") for ln in lines)
    assert any(ln.startswith("last ") and "reward" in ln for ln in lines)


def test_progress_bars_draw_only_on_a_terminal(monkeypatch):
    import sys

    from rlproxy import progress

    assert progress.bar(range(3), desc="x").disable  # pytest's stderr is not a terminal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    for _ in progress.bar(range(3), desc="steps"):
        pass
    assert "steps: 100%" in term.getvalue() and "3/3" in term.getvalue()
