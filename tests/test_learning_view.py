""""Is it learning?" at a glance: the eval gate's held-out reward, the judge's health and why the
trainer waits, in `rlproxy status` (ops/status.py) and on the dashboard (/ui/api/overview and the
page in a real browser). Real servers on the tiny model: real turns, the real eval gate every
step, a real local judge; `render` is also checked on the real answers with figures changed.
Then what the page shows in its first hour: the data when it says it is loaded, the trainer's
true state, empty charts that say so, whole step ticks without repeats, the loss terms that are
off said to be off, and the "Save checkpoint now" button."""

from __future__ import annotations

import argparse
import io
import json
import re
import threading
import time
import zipfile
from pathlib import Path

import pytest
import requests

from conftest import dashboard_page, ServerThread, make_settings, read_records
from demo_agent import run_sessions, training_settings, wait_for_steps
from rlproxy import paths
from rlproxy.demo import run as demo
from rlproxy.ops.status import HELD_OUT_OFF, render, status_cmd
from rlproxy.ops.ui.index import eval_entry
from rlproxy.scoring.scorer import JudgeHealth

CHROMIUM = "/usr/bin/chromium"
SCORING_OPEN = threading.Event()  # cleared: the training reward holds scoring
SCORING_OPEN.set()


def training_reward(turn: dict, next_state) -> float:
    """The scorer's reward: the demo's digit share, once SCORING_OPEN is set."""
    SCORING_OPEN.wait(timeout=50)
    return demo.digit_reward(turn, next_state)


def held_out_reward(turn: dict, next_state) -> float:
    """The eval gate's own reward (held back from training): 0.75 for an odd-length reply."""
    return 0.75 if len(turn["choices"][0]["text"]) % 2 else 0.25


def wait_until(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def healthz(url: str) -> dict:
    return requests.get(url + "/healthz").json()


def status_screen(url: str, capsys) -> list[str]:
    assert status_cmd(argparse.Namespace(url=url, api_key=None)) == 0
    return capsys.readouterr().out.splitlines()


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """Trains a step per 4 turns, the eval gate measuring every candidate on 2 probes with its own
    reward; after 2 evaluations one more session leaves 2 of 4 turns waiting."""
    data = tmp_path_factory.mktemp("data")
    probes = tmp_path_factory.mktemp("probes") / "probes.jsonl"
    probes.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}]}) + "\n")
    settings = make_settings(
        data, train=True, judge=False, at_least_one=False, batch_size=4, baseline="none",
        reward_functions=["test_learning_view:training_reward"], reward_timeout_s=60,
        eval_every=1, eval_probes=2, eval_max_tokens=4, eval_prompts=str(probes),
        eval_tolerance=2.0,  # rewards are in [-1, 1]: no refusal for the reward, no pause
        eval_reward_functions=["test_learning_view:held_out_reward"], learning_rate=1e-3,
        fsync=False, resume=False)
    with ServerThread(settings) as s:
        run_sessions(s.url, 0, 4)
        wait_for_steps(s.url, 2)
        wait_until("2 evals", lambda: len(eval_lines(data)) == 2)
        run_sessions(s.url, 4, 1)
        wait_until("2 turns waiting", lambda: healthz(s.url)["trainer"]["untrained"] == 2)
        s.data_dir = data
        yield s


def eval_lines(data: Path) -> list[dict]:
    return [ln for ln in read_records(data, "training.jsonl") if ln["kind"] == "eval"]


def test_the_overview_carries_the_eval_series_and_the_judge_figures(gated):
    overview = requests.get(gated.url + "/ui/api/overview").json()
    lines = eval_lines(gated.data_dir)
    assert [(e["step"], e["reward"], e["served_reward"], e["passed"], e["kl_base"])
            for e in overview["evals"]] == [
        (ln["step"], ln["candidate"]["reward"], ln["served"]["reward"], ln["passed"],
         ln["candidate"]["kl_base"]) for ln in lines]
    assert len(lines) == 2 and lines[0]["step"] < lines[1]["step"]
    # the means of held_out_reward over 2 probes: the gate's own function, not the training one
    assert all(e["reward"] in {0.25, 0.5, 0.75} for e in overview["evals"])
    health = healthz(gated.url)
    scoring = overview["scoring"]
    assert scoring["verdict"] is None and scoring["judge"] == health["scoring"]["judge"]
    assert scoring["judge"]["released"] == health["scoring"]["released"] == 10
    t = overview["trainer"]
    assert (t["untrained"], t["batch_size"], t["eval_every"]) == (2, 4, 1)
    assert (t["state"], t["state_text"]) == ("waiting", "waiting for 2 more turns")
    assert t["waiting"] == "waiting for 2 more turns: 2 of 4 released turns for the next step"
    assert (t["kl_coef"], t["entropy_coef"]) == (0.0, 0.0)


def test_status_says_held_out_judge_and_why_the_trainer_waits(gated, capsys):
    lines = status_screen(gated.url, capsys)
    first, last = eval_lines(gated.data_dir)
    refused = sum(not ln["passed"] for ln in (first, last))
    assert (f"held-out  reward {last['candidate']['reward']:+.2f} at step {last['step']} (first "
            f"eval {first['candidate']['reward']:+.2f} at step {first['step']}; 2 evals"
            f"{f', {refused} refused' if refused else ''})") in lines, lines
    assert "judge     off (rewards come from reward functions and feedback)" in lines
    i = lines.index("trainer   waiting for 2 more turns: 2 of 4 released turns for the next step")
    t = healthz(gated.url)["trainer"]  # a gate's rollback is a step of its own
    assert lines[i + 1] == (f"          step {t['step']}, 8 turns trained, 2 to train, 0 skipped, "
                            "0 quarantined")


def test_render_on_the_real_answers_with_other_figures(gated):
    health = healthz(gated.url)
    overview = requests.get(gated.url + "/ui/api/overview").json()

    def screen(scoring=None, trainer=None, evals=None, eval_every=1) -> list[str]:
        h = {**health, "scoring": {**health["scoring"], **(scoring or {})},
             "trainer": {**health["trainer"], **(trainer or {})}}
        o = {**overview, "trainer": {**overview["trainer"], "eval_every": eval_every},
             "evals": overview["evals"] if evals is None else evals}
        return render(h, o).splitlines()

    judge = JudgeHealth(good=40, bad=22, undecided=5, skipped=3, lifted=2, released=60,
                        feedback_agree=9, feedback_disagree=1)
    lines = screen({"verdict": "logprob", "judge": judge.summary()})
    i = lines.index("judge     logprob: 40 worked / 22 failed / 5 undecided (7%), 3 skipped")
    assert lines[i + 1] == ("          at-least-one lifted 2 of 60 released (3%); agrees with "
                            "feedback 9 of 10")
    lines = screen({"verdict": "votes", "judge": JudgeHealth().summary()})
    i = lines.index("judge     votes: 0 worked / 0 failed / 0 undecided, 0 skipped")
    assert lines[i + 1] == "          at-least-one lifted 0 of 0 released"

    assert HELD_OUT_OFF in screen(evals=[], eval_every=0)
    assert HELD_OUT_OFF == ("held-out  off: --eval-every N with --eval-prompts FILE and "
                            "--eval-reward-functions module:fn")
    assert "held-out  no evaluations yet (the eval gate runs every 5 steps)" in screen(
        evals=[], eval_every=5)
    gate_lines = [  # as training/gate.py writes them (a failed evaluation has no figures)
        {"kind": "eval", "step": 10, "passed": True, "candidate": {"reward": 0.05},
         "served": {"reward": 0.0}, "refused": None, "time": 1.0},
        {"kind": "eval", "step": 20, "passed": False, "error": "RuntimeError: x",
         "refused": "the evaluation failed: RuntimeError: x", "time": 2.0},
        {"kind": "eval", "step": 30, "passed": True, "candidate": {"reward": 0.12},
         "served": {"reward": 0.05}, "refused": None, "time": 3.0}]
    assert ("held-out  reward +0.12 at step 30 (first eval +0.05 at step 10; 3 evals, "
            "1 refused)") in screen(evals=[eval_entry(ln) for ln in gate_lines])
    assert "held-out  no reward measured (1 eval, 1 refused)" in screen(
        evals=[eval_entry(gate_lines[1])])

    waiting = screen({"pending": 3}, {"untrained": 5, "batch_size": 8})
    assert ("trainer   waiting for 3 more turns: 5 of 8 released turns for the next step; "
            "scoring is the bottleneck: 3 turns not scored yet") in waiting
    assert ("trainer   waiting for 1 more turn: 3 of 4 released turns for the next step"
            in screen({"pending": 0}, {"untrained": 3, "batch_size": 4}))
    assert ("trainer   waiting for 4 more turns: 0 of 4 released turns for the next step; "
            "scoring is the bottleneck: 1 turn not scored yet") in screen(
        {"pending": 1}, {"untrained": 0, "batch_size": 4})
    idle = screen({"pending": 0}, {"untrained": 0, "batch_size": 4})
    assert any(ln.startswith("trainer   idle; step ") for ln in idle), idle
    training = screen(trainer={"untrained": 8, "batch_size": 8})
    assert not any("waiting" in ln for ln in training if ln.startswith("trainer"))
    assert any(ln.startswith("trainer   training; step ") for ln in training)
    assert any(ln.startswith("trainer   paused; step ") for ln in screen(trainer={"paused": True}))
    assert "trainer   off (--no-train)" in render(
        {**health, "trainer": {"enabled": False}}, None).splitlines()


def test_the_learning_panels_in_a_real_browser(gated, tmp_path):
    evals = requests.get(gated.url + "/ui/api/overview").json()["evals"]
    with dashboard_page(gated.url + "/ui") as (page, errors):
        page.wait_for_selector("#chart-heldout")
        # a dot per candidate, a ring more per refused one
        assert page.locator("#chart-heldout circle.pt").count() == len(evals) + sum(
            not e["passed"] for e in evals)
        assert page.locator("#chart-heldout polyline").count() == 2  # candidate, served
        assert page.locator("#trainer-waiting").inner_text() == (
            "waiting for 2 more turns: 2 of 4 released turns for the next step")
        header = page.locator("#status").inner_text()
        assert header.endswith("trainer waiting for 2 more turns")
        judge = page.locator("#judge").inner_text()
        assert "off: rewards come from reward functions and feedback" in judge
        assert "10 turns released to training" in judge
        page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    assert errors == []


# what the page holds the moment it says "loaded": read at once, in one evaluation
SNAPSHOT = """() => {
  const counter = label => [...document.querySelectorAll('#counters .counter')]
    .find(c => c.querySelector('span').textContent === label);
  return {state: document.body.dataset.state,
          header: document.getElementById('status').textContent,
          step: counter('trainer step')?.querySelector('b').textContent ?? null,
          reward_dots: document.querySelectorAll('svg#chart-reward circle.pt').length,
          held_out_dots: document.querySelectorAll('svg#chart-heldout circle.pt').length,
          loss_lines: document.querySelectorAll('svg#chart-loss polyline').length};
}"""
TICKS = """() => Object.fromEntries([...document.querySelectorAll('svg[id^=chart-]')].map(s =>
  [s.id, {x: [...s.querySelectorAll('text.xtick')].map(t => t.textContent),
          y: [...s.querySelectorAll('text.ytick')].map(t => t.textContent)}]))"""
STEP_CHARTS = ("chart-reward", "chart-heldout", "chart-loss")


def check_ticks(charts: dict) -> None:
    """Every axis's labels increase (so none repeats); on an axis of steps they are whole."""
    assert charts
    for chart, axes in charts.items():
        for axis, labels in axes.items():
            values = [float(v) for v in labels]
            assert values and values == sorted(set(values)), (chart, axis, labels)
        if chart in STEP_CHARTS:
            assert all(re.fullmatch(r"-?[0-9]+", v) for v in axes["x"]), (chart, axes["x"])


def test_the_page_says_loaded_only_once_its_data_is_drawn(gated, tmp_path):
    """Four loads, each read the moment the page says it is loaded (`data-state`): the data is
    in it. A screenshot taken at the load event came out blank one time in four (the data came
    after the first paint); Chromium's own network emulation puts the data that late on every
    load but the first, as a slower link to the server would."""
    overview = requests.get(gated.url + "/ui/api/overview").json()
    steps, t, evals = overview["steps"], overview["trainer"], overview["evals"]
    assert len(steps) >= 2 and t["state_text"] == "waiting for 2 more turns"
    with dashboard_page(gated.url + "/ui") as (page, errors):
        link = page.context.new_cdp_session(page)
        link.send("Network.enable")
        for i, latency_ms in enumerate((0, 100, 200, 400)):
            link.send("Network.emulateNetworkConditions", {
                "offline": False, "latency": latency_ms, "downloadThroughput": -1,
                "uploadThroughput": -1})
            page.goto(gated.url + "/ui")  # returns at the load event
            page.wait_for_function("document.body.dataset.state === 'loaded'")
            assert page.evaluate(SNAPSHOT) == {
                "state": "loaded", "step": str(t["step"]), "reward_dots": len(steps),
                "held_out_dots": len(evals) + sum(not e["passed"] for e in evals),
                "loss_lines": 1,  # KL and entropy off
                "header": f"{overview['model']} · adapter v{overview['adapter_version']} · "
                          "trainer waiting for 2 more turns"}, i
            page.screenshot(path=str(tmp_path / f"load-{i}.png"), full_page=True)
            assert (tmp_path / f"load-{i}.png").stat().st_size > 10_000
        # the loss terms that are off (kl_coef, entropy_coef 0) are said to be, not drawn at 0
        assert page.locator("#terms-off").inner_text() == (
            "KL: off (--kl-coef 0) · entropy: off (--entropy-coef 0)")
        assert page.locator(".card h3", has_text="Loss").inner_text() == "Loss"
        check_ticks(page.evaluate(TICKS))
        assert page.evaluate(TICKS)["chart-reward"]["x"] == [str(s["step"]) for s in steps]
    assert errors == []


def test_status_says_when_scoring_is_the_bottleneck(gated, capsys):
    """Last here: it trains a third step once scoring goes on."""
    SCORING_OPEN.clear()
    try:
        run_sessions(gated.url, 5, 1)
        wait_until("2 turns held in scoring", lambda: healthz(gated.url)["scoring"]["pending"] == 2)
        lines = status_screen(gated.url, capsys)
        assert ("trainer   waiting for 2 more turns: 2 of 4 released turns for the next step; "
                "scoring is the bottleneck: 2 turns not scored yet") in lines
    finally:
        SCORING_OPEN.set()
    wait_for_steps(gated.url, 3)


def test_save_checkpoint_now_from_the_adapters_page(gated):
    """Needs POST /ui/api/checkpoints (api/admin.py): it saves the adapter served now and answers
    {"object": "checkpoint", "step", "adapter_version", "path"}; the page then links its .zip."""
    last = wait_until("step 3's verdict", lambda: eval_lines(gated.data_dir)[2:][-1:])[0]
    assert last["passed"]
    served = last["candidate_version"]  # the gate publishes a passed candidate: wait for that
    wait_until("step 3's adapter served", lambda: healthz(gated.url)["adapter_version"] == served)
    with dashboard_page(gated.url + "/ui#/adapters") as (page, errors):
        page.click("#save-checkpoint")
        page.wait_for_selector("#saved")
        said = page.locator("#saved").inner_text()
        assert said.startswith("Saved step ") and f"(adapter v{served})" in said, said
        href = page.locator("#saved-download").get_attribute("href")
        step = int(re.fullmatch(r"/ui/api/adapters/([0-9]+)\.zip", href)[1])
        page.wait_for_function(  # the table lists it at the next refresh
            f"[...document.querySelectorAll('td:first-child')].some(td => td.textContent === "
            f"'{step}')")
    assert errors == []
    kept = paths.kept_checkpoint(gated.data_dir / paths.CHECKPOINTS, step)
    assert kept is not None
    assert json.loads((kept / paths.TRAINER_STATE).read_text())["adapter_version"] == served
    got = requests.get(gated.url + href)
    assert got.status_code == 200 and got.headers["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(got.content)) as z:
        assert any(n.endswith("adapters.safetensors") for n in z.namelist())


def test_idle_empty_charts_then_every_loss_term_drawn(tmp_path):
    """A trainer with nothing to train is idle and its charts say there are no steps yet (no
    axes, no ticks); after two steps with the KL penalty and the entropy bonus on, both are
    drawn beside the loss on whole step ticks; paused says paused. Saving a checkpoint before
    the first step fails, and the page says why."""
    with ServerThread(training_settings(tmp_path, kl_coef=0.05, entropy_coef=0.01)) as s:
        with dashboard_page(s.url + "/ui") as (page, errors):
            assert page.locator("#status").inner_text().endswith(" · trainer idle")
            for chart in ("#chart-reward", "#chart-loss"):
                assert page.locator(chart).inner_text() == "no optimizer steps yet"
            assert page.locator("svg#chart-reward, svg#chart-loss, #trainer-waiting").count() == 0
            page.wait_for_selector("svg#chart-tps")  # 0 tokens/s: a flat line on a true axis
            charts = page.evaluate(TICKS)
            assert charts["chart-tps"]["y"][0] == "0.0"  # from 0: a rate is never below
            check_ticks(charts)
            page.goto(s.url + "/ui#/adapters")  # no step yet: nothing to save, and it says why
            page.wait_for_function("document.body.dataset.loaded === '#/adapters'")
            page.click("#save-checkpoint")
            said = page.wait_for_selector("#saved.neg").inner_text()
            assert said.startswith("Could not save a checkpoint: ") and len(said) > 40, said
            assert page.locator("#saved-download").count() == 0
        run_sessions(s.url, 0, 2)
        wait_for_steps(s.url, 2)
        steps = [ln["step"] for ln in read_records(tmp_path, "training.jsonl")
                 if ln["kind"] == "step"]
        with dashboard_page(s.url + "/ui") as (page, more_errors):
            loss = page.locator(".card", has=page.locator("svg#chart-loss"))
            assert loss.locator("h3").inner_text() == "Loss, KL and entropy"
            assert [line.get_attribute("data-name") for line in
                    loss.locator("polyline").all()] == ["loss", "KL", "entropy"]
            assert page.locator("#terms-off").count() == 0
            charts = page.evaluate(TICKS)
            check_ticks(charts)
            assert charts["chart-reward"]["x"] == charts["chart-loss"]["x"] == [
                str(n) for n in steps]
            assert requests.post(s.url + "/v1/training/pause").status_code == 200
            page.wait_for_function("document.getElementById('status').textContent"
                                   ".endsWith(' · trainer paused')")
    assert errors == more_errors == []


# ---- a real local judge (the tiny model, log-prob verdicts) ----

def test_the_judge_figures_of_real_verdicts_in_status_and_the_browser(tiny, tmp_path, capsys):
    def share(x):
        return "" if x is None else f" ({x:.0%})"

    with ServerThread(make_settings(tmp_path, prm_verdict="logprob"), tiny) as s:
        run_sessions(s.url, 0, 2)
        wait_until("4 turns scored", lambda: (healthz(s.url)["scoring"]["scored"], healthz(
            s.url)["scoring"]["pending"]) == (4, 0))
        time.sleep(0.5)  # the last session's releases (at-least-one) follow its last score
        j = healthz(s.url)["scoring"]["judge"]
        lines = read_records(tmp_path, "prm_scores.jsonl")  # a session's last turn: no judge
        judged = [ln for ln in lines if ln["kind"] == "score" and ln["judged"]]
        assert j["good"] + j["bad"] + j["undecided"] == len(judged) == 2
        assert j["lifted"] == sum(ln.get("reason") == "at_least_one" for ln in lines)
        lines = status_screen(s.url, capsys)
        verdicts = (f"{j['good']} worked / {j['bad']} failed / {j['undecided']} undecided"
                    f"{share(j['undecided_share'])}, 0 skipped")
        i = lines.index(f"judge     logprob: {verdicts}")
        assert lines[i + 1] == (f"          at-least-one lifted {j['lifted']} of "
                                f"{j['released']} released{share(j['lifted_share'])}")
        assert "trainer   off (--no-train)" in lines and HELD_OUT_OFF in lines
        overview = requests.get(s.url + "/ui/api/overview").json()
        assert overview["scoring"]["judge"] == j and overview["evals"] == []
        sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
        if not Path(CHROMIUM).exists():
            pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.goto(s.url + "/ui")
                page.wait_for_selector("#judge")
                judge = page.locator("#judge").inner_text()
                empty = page.locator("#chart-heldout").inner_text()
                steps = page.locator("#chart-reward").inner_text()
                bar = page.locator("#judge .bar span").count()
                svg = page.locator("#chart-heldout svg, svg#chart-heldout").count()
                header = page.locator("#status").inner_text()
            finally:
                browser.close()
    assert "Judge (PRM): logprob" in judge and verdicts in judge and bar == 3
    assert f"at-least-one lifted {j['lifted']} of {j['released']} released" in judge
    assert empty.startswith("no evaluations yet") and svg == 0
    assert steps == "no optimizer steps yet" and "trainer off" in header
