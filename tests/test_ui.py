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

from conftest import dashboard_page, ServerThread, make_settings, read_records
from demo_agent import run_sessions, training_settings, wait_for_steps
from rlproxy.appkeys import MODEL, SETTINGS, TRAINER
from rlproxy.demo.run import REWARD_FUNCTION
from rlproxy.ops.ui.index import RecordIndex

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


def test_the_index_rebuilds_when_a_file_is_truncated_or_rotated(tmp_path):
    path, now = tmp_path / "conversations.jsonl", time.time()
    path.write_bytes(b"".join(turn_line(f"old{i}", "s", i, now) for i in range(20)))
    index = RecordIndex(tmp_path)
    index.refresh()
    # logrotate's copytruncate: same file, emptied, then a shorter new history
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(turn_line("a", "s", 0, now) + turn_line("b", "t", 0, now))
    index.refresh()
    assert [t["uid"] for t in index.session_turns("s")] == ["a"] and set(index.turns) == {"a", "b"}
    # a rotation by rename: another inode, as long as the old file or longer
    path.rename(tmp_path / "conversations.jsonl.1")
    path.write_bytes(b"".join(turn_line(f"new{i}", "s", i, now) for i in range(30)))
    index.refresh()
    assert [t["uid"] for t in index.session_turns("s")] == [f"new{i}" for i in range(30)]
    # rotated between a refresh and a read: stale offsets are skipped, never a JSON error
    path.write_bytes(b"x" * 100_000)
    assert index.session_turns("s") == []


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
    assert browser.get(url + "/ui/api/overview").json()["trainer"] == {
        "enabled": False, "state": "off", "state_text": "off", "waiting": None}
    assert browser.get(url + "/v1/models").status_code == 401  # the cookie is for /ui only
    # the cookie alone does not make an action: a form on another port of this host sends it
    for headers in ({}, {"Origin": "http://127.0.0.1:1"}, {"Sec-Fetch-Site": "same-site"}):
        forged = browser.post(url + "/ui/api/training/pause", headers=headers)
        assert forged.status_code == 403, headers
        assert forged.json()["error"]["code"] == "cross_site_request"
    for headers in ({"X-RLProxy-UI": "1"}, {"Origin": url}, {"Sec-Fetch-Site": "same-origin"}):
        assert browser.post(url + "/ui/api/training/pause", headers=headers).status_code == 409
    assert requests.post(url + "/ui/api/training/pause", headers=AUTH).status_code == 409
    # with the key: training is off here, and there is no checkpoint to serve
    assert requests.post(url + "/v1/training/pause", headers=AUTH).status_code == 409
    missing = requests.post(url + "/v1/adapters/7/serve", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
    assert requests.post(url + "/v1/adapters/x/serve", headers=AUTH).status_code == 400
    assert requests.get(url + "/ui/api/sessions/nope", headers=AUTH).status_code == 404
    assert requests.get(url + "/ui/api/sessions/nope?start=x", headers=AUTH).status_code == 400
    assert requests.get(url + "/ui/api/adapters/3.zip", headers=AUTH).status_code == 404


def test_a_long_session_opens_on_its_latest_turns_and_pages_back(keyed):
    data = keyed.app[SETTINGS].records.data_dir
    with open(data / "conversations.jsonl", "ab") as f:
        f.writelines(turn_line(f"long{i}", "long", i, time.time()) for i in range(250))
    get = lambda q="": requests.get(keyed.url + "/ui/api/sessions/long" + q, headers=AUTH).json()
    latest = get()
    assert latest["recorded_turns"] == 250 and latest["start"] == 150 and latest["page"] == 100
    assert [t["uid"] for t in latest["turns"]] == [f"long{i}" for i in range(150, 250)]
    assert [t["uid"] for t in get("?start=50")["turns"]] == [f"long{i}" for i in range(50, 150)]
    assert requests.get(keyed.url + "/ui/api/sessions/long?start=-1",
                        headers=AUTH).status_code == 400
    js = (Path(__file__).resolve().parent.parent / "rlproxy" / "ops" / "ui" / "static" / "app.js")
    assert "?start=" in js.read_text()  # the page asks for the other pages


def test_damaged_checkpoints_are_left_out_of_the_list(keyed):
    root = keyed.app[SETTINGS].records.data_dir / "checkpoints"
    for name, state in (("step_000005", b"{not json"), ("step_000006", b'{"step": 6}')):
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_bytes(state)
    try:
        r = requests.get(keyed.url + "/ui/api/adapters", headers=AUTH)
        assert r.status_code == 200 and r.json()["checkpoints"] == []
        # complete-looking but its adapter is gone (pruned mid-request): 404, not 500
        zipped = requests.get(keyed.url + "/ui/api/adapters/5.zip", headers=AUTH)
        assert zipped.status_code == 404 and zipped.json()["error"]["code"] == \
            "checkpoint_not_found"
    finally:
        shutil.rmtree(root)


def test_status_says_one_line_when_the_server_is_not_rlproxy(tmp_path, capsys):
    import argparse
    import http.server
    import threading

    from rlproxy.ops.served import free_port
    from rlproxy.ops.status import status_cmd

    class NotJson(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>some other server</html>")

        def log_message(self, *a):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), NotJson)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{other.server_port}"
        assert status_cmd(argparse.Namespace(url=url, api_key=None)) == 1
    finally:
        other.shutdown()
    closed = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    assert status_cmd(argparse.Namespace(url=closed, api_key=None)) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "did not answer JSON" in err[0] and "cannot reach" in err[1]


def test_pages_insert_recorded_text_as_text_only():
    static = Path(__file__).resolve().parent.parent / "rlproxy" / "ops" / "ui" / "static"
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
        # above every version recorded: the checkpoint itself names version 2
        assert r.status_code == 200 and r.json()["adapter_version"] == 3
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 3
        served = greedy(s, tmp_path)
        assert served["completion_ids"] == fresh_greedy(
            s.app[MODEL].source, tmp_path / "checkpoints" / "step_000002", served["prompt_ids"],
            len(served["completion_ids"]))
        broken = tmp_path / "checkpoints" / "step_000009"  # complete-looking, unreadable
        shutil.copytree(tmp_path / "checkpoints" / "step_000002", broken)
        (broken / "adapters.safetensors").write_bytes(b"not safetensors")
        r = requests.post(s.url + "/v1/adapters/9/serve")
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_unusable"
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 3
        another_layout(tmp_path / "checkpoints" / "step_000002",
                       tmp_path / "checkpoints" / "step_000008", 8)
        r = requests.post(s.url + "/v1/adapters/8/serve")
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_unusable"
        assert requests.get(s.url + "/healthz").json()["adapter_version"] == 3
    assert read_records(tmp_path, "training.jsonl")[-1]["kind"] == "rollback"
    # restarted (the engine starts at version 0 again): a new rollback takes a version never
    # recorded before, so training.jsonl and the turns' adapter_versions stay unambiguous
    with ServerThread(make_settings(tmp_path)) as s:
        r = requests.post(s.url + "/v1/adapters/2/serve")
        assert r.status_code == 200 and r.json()["adapter_version"] == 4


def another_layout(src: Path, dst: Path, step: int) -> Path:
    """A complete checkpoint whose LoRA has half the rank (MLX would load it without a word)."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "adapters.safetensors"))
    halved = {k: v[:, : v.shape[1] // 2] if k.endswith("lora_a") else
              v[: v.shape[0] // 2] if k.endswith("lora_b") else v for k, v in weights.items()}
    mx.save_safetensors(str(dst / "adapters.safetensors"), halved)
    state = orjson.loads((dst / "trainer_state.json").read_bytes())
    (dst / "trainer_state.json").write_bytes(orjson.dumps({**state, "step": step}))
    return dst


def test_a_checkpoint_of_another_lora_layout_is_refused_and_nothing_changes(trained):
    url, root = trained.url, trained.data_dir / "checkpoints"
    bad = another_layout(root / "step_000002", root / "step_000099", 99)
    try:
        before = requests.get(url + "/healthz").json()
        r = requests.post(url + "/v1/adapters/99/serve")
        assert r.status_code == 409 and r.json()["error"]["code"] == "checkpoint_unusable"
        after = requests.get(url + "/healthz").json()
        assert after["adapter_version"] == before["adapter_version"]
        assert after["trainer"]["step"] == before["trainer"]["step"] and after["status"] == "ok"
        greedy(trained, trained.data_dir)  # still serving
    finally:
        shutil.rmtree(bad)


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
            # no eval gate here: the held-out chart says so instead of drawing bare axes
            held_out = page.locator("#chart-heldout")
            assert held_out.inner_text().startswith("no evaluations yet: --eval-every N")
            assert page.locator("svg#chart-heldout").count() == 0
            assert "off: rewards come from reward functions" in page.locator("#judge").inner_text()
            # every released turn trained (its step's books settle after its line), none being
            # scored: idle, and the header says so
            page.wait_for_function("document.getElementById('status').textContent"
                                   ".endsWith(' · trainer idle')")
            assert page.locator("#trainer-waiting").count() == 0
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

    from rlproxy.ops.status import status_cmd

    deadline = time.monotonic() + 60  # the last step's turns leave the books after its line
    while requests.get(trained.url + "/healthz").json()["trainer"]["untrained"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert status_cmd(argparse.Namespace(url=trained.url, api_key=None)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 24
    assert "model rlproxy-embedded-tiny" in lines[0] and "adapter v" in lines[0]
    assert any(ln.startswith("trainer   idle; step ") for ln in lines), lines
    assert "judge     off (rewards come from reward functions and feedback)" in lines
    assert ("held-out  off: --eval-every N with --eval-prompts FILE and --eval-reward-functions "
            "module:fn") in lines
    assert any(ln.startswith("cache     hit rate") for ln in lines)
    assert any(ln.startswith("last ") and "reward" in ln for ln in lines)
    assert any(ln.startswith("serving ") and " GiB (peak " in ln for ln in lines), lines


def test_progress_bars_draw_only_on_a_terminal(monkeypatch):
    import sys

    from rlproxy.ops import progress

    assert progress.bar(range(3), desc="x").disable  # pytest's stderr is not a terminal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    for _ in progress.bar(range(3), desc="steps"):
        pass
    assert "steps: 100%" in term.getvalue() and "3/3" in term.getvalue()


def test_a_rollback_that_times_out_is_withdrawn_and_the_trainer_lives(trained, monkeypatch):
    from rlproxy.api import admin as control

    monkeypatch.setattr(control, "ROLLBACK_TIMEOUT_S", 0.0)  # the trainer is never in time
    for _ in range(3):
        before = requests.get(trained.url + "/healthz").json()["adapter_version"]
        r = requests.post(trained.url + "/v1/adapters/2/serve")
        time.sleep(0.5)  # the trainer had it in its inbox: it must drop it, not apply it
        health = requests.get(trained.url + "/healthz").json()
        if r.status_code == 503:  # withdrawn (almost always)
            assert "nothing changed" in r.json()["error"]["message"]
            assert health["adapter_version"] == before
        else:  # the trainer took it in the microseconds before the withdrawal: answered
            assert r.status_code == 200 and health["adapter_version"] == before + 1
        assert trained.app[TRAINER].alive and not health["trainer"].get("error")
    monkeypatch.setattr(control, "ROLLBACK_TIMEOUT_S", 300.0)
    assert requests.post(trained.url + "/v1/adapters/2/serve").status_code == 200


def test_a_rollback_keeps_the_checkpoint_it_rolled_back_to(trained):
    """Last in this module: it prunes the trained server's older checkpoints."""
    root, trainer = trained.data_dir / "checkpoints", trained.app[TRAINER]
    trainer.t.keep_checkpoints = 1
    try:
        r = requests.post(trained.url + "/v1/adapters/1/serve")
        assert r.status_code == 200, r.text
    finally:
        trainer.t.keep_checkpoints = 50
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == ["step_000001", f"step_{r.json()['step']:06d}"]


# ---- the eval gate's rollbacks: /healthz, the actions table, the reward chart ----

@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server whose learning rate is too high for its gate (as `rlproxy demo --guard`): each
    step's candidate is refused and rolled back; the third in a row pauses training."""
    data = tmp_path_factory.mktemp("data")
    settings = make_settings(data, train=True, judge=False, at_least_one=False,
                             reward_functions=[REWARD_FUNCTION], batch_size=2, fsync=False,
                             learning_rate=2e-2, resume=False, **GUARD)
    with ServerThread(settings) as s:
        run_sessions(s.url, 0, 3)
        deadline = time.monotonic() + 120
        while not (requests.get(s.url + "/healthz").json()["trainer"]["error"] or "").startswith(
                "training paused"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        s.data_dir = data
        yield s


GUARD = {"eval_every": 1, "max_kl": 0.6, "eval_probes": 4, "eval_max_tokens": 8}


def test_three_gate_rollbacks_in_a_row_pause_training_with_the_reason_on_healthz(guarded):
    h = requests.get(guarded.url + "/healthz").json()
    assert h["status"] == "ok" and h["adapter_version"] == 0  # nothing refused was served
    t = h["trainer"]
    assert t["alive"] and t["gate_rollbacks"] == 3 and t["evals"] == 3
    assert t["error"].startswith("training paused: 3 rollbacks in a row by the eval gate; "
                                 "the last: ") and "max_kl 0.6" in t["error"]
    events = requests.get(guarded.url + "/ui/api/overview").json()["events"]
    gate = [e for e in events if e["kind"] == "rollback"]
    assert [e["step"] for e in gate] == [2, 4, 6] and all(e["gate"] for e in gate)
    assert events[-1]["kind"] == "pause" and events[-1]["reason"] == t["error"]


def test_the_reward_chart_marks_each_rollback_in_a_real_browser(guarded, tmp_path):
    with dashboard_page(guarded.url + "/ui") as (page, errors):
        page.wait_for_selector("#chart-reward line.rollback", state="attached")  # 0 wide
        marks = page.locator("#chart-reward line.rollback")
        assert marks.count() == 3
        assert "max_kl 0.6" in marks.first.locator("title").text_content()
        assert "trainer paused" in page.locator("#status").inner_text()
        page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
        page.goto(guarded.url + "/ui#/adapters")
        page.wait_for_function("document.body.dataset.loaded === '#/adapters'")
        assert page.get_by_text("candidate v1 refused").count() == 1
        assert page.get_by_text("learning rate x0.125").count() == 1
    assert errors == []


# ---- a pending turn's header, the turn count, the PEFT download (issue 22) ----

def test_pending_header_turn_count_and_peft_download_in_a_real_browser(tiny, taught_adapter,
                                                                       tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from rlproxy.serving.peft import from_peft, is_peft_dir, read_adapter
    from rlproxy.training.checkpoints import save_checkpoint

    data = tmp_path / "data"
    adapter = mx.load(str(taught_adapter / "adapters.safetensors"))
    save_checkpoint(data / "checkpoints", 1, 1, adapter, {}, tiny.lora_config, {})
    with ServerThread(make_settings(data), tiny) as s:
        first = s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            extra_headers={"X-Session-Id": "two"})
        s.client().chat.completions.create(  # files turn #0; this one, #1, stays pending
            model="m", max_tokens=3, extra_headers={"X-Session-Id": "two"}, messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}])
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(s.url + "/ui#/session/two")
                page.wait_for_function("document.body.dataset.loaded === '#/session/two'")
                cards = page.locator(".turn h3").all_inner_texts()
                title = page.locator("h2").first.inner_text()
                page.goto(s.url + "/ui#/adapters")
                page.wait_for_function("document.body.dataset.loaded === '#/adapters'")
                link = page.get_by_text("download as PEFT").first.get_attribute("href")
            finally:
                browser.close()
        assert len(cards) == 2 and title.endswith("· 2 turns (1 recorded, 1 pending)"), title
        pending = cards[1]
        assert pending.startswith("#1 · pending · main · chat · "), pending
        assert "–" not in pending and pending.endswith("tokens · adapter v0"), pending
        got = requests.get(s.url + link)
    assert got.status_code == 200 and got.headers["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(got.content)) as z:
        z.extractall(tmp_path / "zip")
    (folder,) = (tmp_path / "zip").iterdir()
    assert is_peft_dir(folder)
    weights, config = from_peft(*read_adapter(folder), len(tiny.model.layers))
    assert weights.keys() == adapter.keys()
    assert all(mx.array_equal(weights[k], adapter[k]).item() for k in adapter)


def test_the_pending_count_is_the_same_on_every_page(tiny, tmp_path):
    """A live session with an open turn and 150 recorded ones: every page says 1 pending (the
    header's total), and only the last one shows it."""
    with ServerThread(make_settings(tmp_path), tiny) as s:
        first = s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            extra_headers={"X-Session-Id": "paged"})
        s.client().chat.completions.create(  # files turn #0; this one stays pending
            model="m", max_tokens=3, extra_headers={"X-Session-Id": "paged"}, messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}])
        deadline = time.time() + 15
        while not read_records(tmp_path) and time.time() < deadline:
            time.sleep(0.05)
        with open(tmp_path / "conversations.jsonl", "ab") as f:
            f.writelines(turn_line(f"p{i}", "paged", i + 1, time.time()) for i in range(150))
        get = lambda q="": requests.get(s.url + "/ui/api/sessions/paged" + q).json()  # noqa
        earlier, latest = get("?start=0"), get()
    assert earlier["recorded_turns"] == latest["recorded_turns"] == 151
    assert earlier["pending_turns"] == latest["pending_turns"] == 1
    assert earlier["waiting"] == [] and len(latest["waiting"]) == 1
