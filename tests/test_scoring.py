"""Scoring against the next state: the math, and real sessions through the proxy judged by a small
real aiohttp judge server (the one narrow fake: its verdicts are scripted by the test). What the
trainer would be handed is captured by setting the scorer's `on_released` (--no-train: nothing
else reads it). Tests wait on conditions (/healthz, lines on disk), never on a fixed sleep."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter

import mlx.core as mx
import pytest
import requests
from aiohttp import web

from rlproxy.appkeys import ENGINE, SCORER
from rlproxy.scoring import judging as scoring
from rlproxy.serving.model import lora_weights
from conftest import AppThread, ServerThread, make_settings, read_records

# ---- the math ----


@pytest.mark.parametrize("text,vote", [
    (r"clearly \boxed{1}", 1), (r"\boxed{1} no wait \boxed{-1}", -1), (r"\boxed{ 0 }", 0),
    (r"\boxed{2}", None), ("no verdict", None), ("", None), (r"\boxed{+1}", 1),
])
def test_parse_vote_takes_the_last_boxed(text, vote):
    assert scoring.parse_vote(text) == vote


@pytest.mark.parametrize("votes,result", [
    ([1, 1, -1], 1), ([-1, -1, 1], -1), ([1, -1, 0], 0), ([1, -1], 0), ([None, None, -1], -1),
    ([None, None, None], 0), ([], 0), ([0, 0, 1], 0), ([1, None, 1], 1),
])
def test_majority(votes, result):
    assert scoring.majority(votes) == result


def test_hints_and_rewards():
    assert scoring.best_hint(["[HINT_START] short [HINT_END]", "[NO_HINT]",
                              "[HINT_START]a longer hint[HINT_END]"]) == "a longer hint"
    assert scoring.best_hint(["[NO_HINT]", "[HINT_START]  [HINT_END]"]) is None
    assert scoring.final_reward(1, None, -0.5, "override") == -0.5
    assert scoring.final_reward(1, 0.25, None, "override") == 0.25
    assert scoring.final_reward(1, None, 0.5, "add") == 1.0  # clipped
    assert scoring.final_reward(-1, None, 0.5, "add") == -0.5
    assert scoring.final_reward(None, None, None, "add") is None


def test_advantage_dispatch_all_four_cases():
    b, t = [-1.0, -2.0], [-0.5, -3.0]
    assert scoring.token_advantages(b, t, 1.0, 2.0, 0.5) == [2 * 0.5 + 0.5, 2 * -1.0 + 0.5]
    assert scoring.token_advantages(b, t, None, 2.0, 0.5) == [1.0, -2.0]  # opd only
    assert scoring.token_advantages(b, None, -1.0, 2.0, 0.5) == [-0.5, -0.5]  # rl only: no noise
    assert scoring.token_advantages(b, None, None, 2.0, 0.5) is None  # nothing to train


def test_at_least_one():
    assert scoring.at_least_one({"a": (0, -1.0), "b": (1, 0.0), "c": (2, 0.0)}) == "c"
    assert scoring.at_least_one({"a": (0, -1.0), "b": (1, -1.0)}) == "b"
    assert scoring.at_least_one({"a": (0, -1.0), "b": (1, 1.0)}) is None
    assert scoring.at_least_one({}) is None


def test_the_verdict_prompt_of_an_agent_length_turn_stays_small():
    """A Hermes-sized turn (a long system prompt, 20 tool schemas' worth of text, a long request,
    a tool call, and a next state of two long tool results and a user reply) fills the verdict
    prompt with a bounded tail: what the judge prefills per turn does not grow with the turn."""
    from rlproxy.settings import PRM_PROMPTS_DIR

    template = scoring.load_prompts(PRM_PROMPTS_DIR)["verdict_txt"]
    turn = {"messages": [{"role": "system", "content": "You are an agent. " * 2000},
                         {"role": "user", "content": "Refactor the billing module. " * 1500}],
            "choices": [{"text": "", "tool_calls": [{"function": {
                "name": "terminal", "arguments": '{"command": "pytest -x tests/"}'}}]}],
            "next_state": [
                {"role": "tool", "name": "terminal",
                 "content": "collected 900 items\n" + ". " * 20000
                 + "\nFAILED tests/test_billing.py::test_refund - KeyError: 'amount'"},
                {"role": "tool", "name": "read_file", "content": "x = 1\n" * 5000},
                {"role": "user", "content": "It still fails, look at the refund path."}]}
    prompt = scoring.fill_verdict_prompt(template, turn, 4000)
    head, tail = scoring.split_head(prompt)
    assert head + "\n\n" == template[:template.rindex("Next: {next_state}")]  # the examples
    assert len(tail) < scoring.VERDICT_STATE_CHARS + 80
    assert tail.startswith("\n\nNext: (tool's result) collected 900 items")
    assert "KeyError: 'amount' (tool's result) x = 1" in tail  # each message's end is kept
    assert tail.endswith("(user's reply) It still fails, look at the refund path.\nResult:")


# ---- a scripted judge on a real port ----


class Judge:
    """Answers /v1/chat/completions (votes, hints) and /v1/completions (log-prob verdicts). The
    next state of the judged turn carries the script: `[votes 1,-1,garbage,timeout]` (the k-th
    call for that turn gets the k-th item), `[hint yes]` (hint prompts get a hint) and
    `[verdict -0.1,-2.3]` (the log-probs of " worked" and " failed" at the label position; `_`
    leaves that label out of the top log-probs). A verdict prompt without a script gets a
    completion with no log-probs, as a server that gives none. `shape` is how log-probs are
    asked for and answered: "legacy" (OpenAI's `logprobs: 20`, as vLLM) or "content" (mlx-lm's
    server: `logprobs: true, top_logprobs`; an integer `logprobs` is a 400). `down` makes every
    call a 503 (an outage)."""

    def __init__(self, shape: str = "legacy"):
        self.down = False
        self.shape = shape
        self.refused = 0  # calls answered 503 while down
        self.calls: Counter = Counter()
        self.verdicts: Counter = Counter()  # next state -> verdict calls
        self.thread = AppThread(self._app)

    def _app(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _complete(self, request):
        if self.down:
            self.refused += 1
            return web.json_response({"error": {"message": "down"}}, status=503)
        body = await request.json()
        after = body["prompt"].rsplit("\nNext:", 1)[-1]  # this turn's part, after the examples
        if self.shape == "content" and not isinstance(body.get("logprobs"), bool):
            return web.json_response({"error": "logprobs must be a bool"}, status=400)
        self.verdicts[after] += 1  # answered
        script = re.search(r"\[verdict ([^,\]]*),([^\]]*)\]", after)
        choice = {"index": 0, "text": " worked", "finish_reason": "length"}
        if script:
            top = {t: float(v) for t, v in ((" worked", script[1]), (" failed", script[2]))
                   if v.strip() != "_"}
            top[" the"] = -5.0
            choice["logprobs"] = ({"tokens": [" worked"], "top_logprobs": [top]}
                                  if self.shape == "legacy" else
                                  {"content": [{"token": "\u0120worked", "logprob": -0.1,
                                                "top_logprobs": [
                                                    {"token": t.replace(" ", "\u0120"),
                                                     "logprob": v} for t, v in top.items()]}]})
        return web.json_response({"choices": [choice]})

    async def _chat(self, request):
        if self.down:
            self.refused += 1
            return web.json_response({"error": {"message": "down"}}, status=503)
        body = await request.json()
        prompt = body["messages"][0]["content"]
        after = prompt.split("## What came next (the next state)", 1)[-1]
        if "[HINT_START]" in prompt:  # the hint prompt
            text = ("[HINT_START]Check the city name first.[HINT_END]" if "[hint yes]" in after
                    else "[NO_HINT]")
            return web.json_response({"choices": [{"message": {"content": text}}]})
        script = re.search(r"\[votes ([^\]]*)\]", after)
        items = script.group(1).split(",") if script else ["0"]
        key = after
        k = self.calls[key]
        self.calls[key] += 1
        item = items[k % len(items)].strip()
        if item == "timeout":
            await asyncio.sleep(5)
        text = "hmm, hard to say" if item == "garbage" else f"Reasoning... \\boxed{{{item}}}"
        return web.json_response({"choices": [{"message": {"content": text}}]})

    def __enter__(self):
        self.thread.__enter__()
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)

    @property
    def url(self):
        return self.thread.url + "/v1"


@pytest.fixture
def judge():
    with Judge() as j:
        yield j


def proxy(tiny, tmp_path, judge, **flags):
    """The proxy judged by JUDGE: with votes unless FLAGS ask for log-prob verdicts."""
    settings = make_settings(tmp_path, judge_url=judge.url, judge_timeout_s=1.0,
                             judge_retries=1, **{"prm_verdict": "votes", **flags})
    return ServerThread(settings, tiny)


def capture(server) -> list[dict]:
    """What the scorer hands on (the trainer's submit, were training on), in order."""
    released: list[dict] = []
    server.app[SCORER].on_released = released.append
    return released


def wait_for(condition, timeout=30.0, what="a condition"):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def chat(server, sid, messages, **headers):
    r = server.client().chat.completions.create(
        model="m", messages=messages, max_tokens=4, seed=1,
        extra_headers={"X-Session-Id": sid, **headers})
    return {"role": "assistant", "content": r.choices[0].message.content}


def run_session(server, sid, next_texts, done=True):
    """Turn i's next state is a user message next_texts[i]; the last turn ends the session."""
    messages = [{"role": "user", "content": "Please check the weather."}]
    for text in next_texts:
        messages += [chat(server, sid, messages), {"role": "user", "content": text}]
    chat(server, sid, messages, **({"X-Session-Done": "1"} if done else {}))


def wait_scored(server, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = requests.get(server.url + "/healthz").json()["scoring"]
        if stats["scored"] >= n and stats["pending"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"only {stats['scored']} of {n} turns scored: {stats}")


def lines(data_dir, kind):
    return [r for r in read_records(data_dir, "prm_scores.jsonl") if r["kind"] == kind]


def wait_lines(data_dir, kind, n):
    """Until N lines of KIND are on disk (release lines are queued for the writer thread)."""
    wait_for(lambda: len(lines(data_dir, kind)) >= n, what=f"{n} {kind} lines")


def by_index(data_dir, kind="score"):
    return {r["index"]: r for r in lines(data_dir, kind)}


def test_majority_failed_votes_and_ties_through_the_proxy(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge, at_least_one=False) as s:
        run_session(s, "maj", ["[votes 1,1,-1] thanks", "[votes 1,-1,0] hmm",
                               "[votes garbage,garbage,-1] no, redo it",
                               "[votes timeout,1,1] great", "[votes garbage,1,-1] ok"])
        wait_scored(s, 6)
    scores = by_index(tmp_path)
    # a tie or no valid vote: undecided, no judge reward
    assert [scores[i]["judge_reward"] for i in range(5)] == [1, None, -1, 1, None]
    assert [v["vote"] for v in scores[2]["votes"]].count(None) == 2  # garbage: invalid
    assert all(v["text"] == "hmm, hard to say" for v in scores[2]["votes"] if v["vote"] is None)
    assert sum(v["error"] is not None for v in scores[3]["votes"]) == 1  # the timed-out vote
    assert scores[5]["votes"] == [] and scores[5]["reward"] is None  # last turn: no next state
    assert len(scores[0]["votes"]) == 3


def test_at_least_one_lifts_the_best_turn_of_a_negative_session(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge) as s:
        run_session(s, "neg", ["[votes -1,-1,-1] wrong", "[votes 0,0,0] unclear",
                               "[votes -1,-1,0] wrong again"])
        run_session(s, "pos", ["[votes 1,1,1] thanks", "[votes -1,-1,-1] wrong"])
        wait_scored(s, 7)
        wait_lines(tmp_path, "release", 7)
    releases = {(r["session_id"], r["index"]): r for r in lines(tmp_path, "release")}
    # turn 1's votes were all 0 ("unclear"): undecided, so never lifted; the best decided
    # turn, the latest among equals, is
    lifted = releases[("neg", 2)]
    assert lifted["reward"] == 1.0 and lifted["reason"] == "at_least_one"
    assert releases[("neg", 0)]["reward"] == -1 and releases[("neg", 1)]["reward"] is None
    assert releases[("pos", 0)]["reward"] == 1 and releases[("pos", 1)]["reward"] == -1
    assert not any(r["reason"] == "at_least_one" for k, r in releases.items() if k[0] == "pos")


def test_combine_dispatch_opd_rl_and_rl_only_and_nothing(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge, method="combine", w_opd=1.0, w_rl=0.5) as s:
        released = capture(s)
        run_session(s, "comb", ["[votes 1,1,1] [hint yes] thanks", "[votes -1,-1,-1] no"])
        wait_scored(s, 3)
        wait_for(lambda: len(released) == 2, what="2 released turns")
    scores = by_index(tmp_path)
    both, rl_only, last = scores[0], scores[1], scores[2]
    assert both["hint"] == "Check the city name first." and both["teacher_logprobs"]
    assert rl_only["hint"] is None and rl_only["teacher_logprobs"] is None
    assert last["teacher_logprobs"] is None and last["reward"] is None
    adv = {r["turn"]["index"]: r["advantages"] for r in released}
    assert set(adv) == {0, 1}  # the last turn has nothing to train on
    turn0 = next(r for r in released if r["turn"]["index"] == 0)
    behaviour = turn0["turn"]["choices"][0]["logprobs"]
    expected = [1.0 * (t - b) + 0.5 * 1 for t, b in zip(both["teacher_logprobs"], behaviour)]
    assert adv[0] == pytest.approx(expected)
    assert adv[1] == [0.5 * -1] * len(adv[1])  # no teacher: the OPD term is exactly 0


def test_opd_only_and_teacher_logprobs_are_exact(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge, method="opd") as s:  # teacher: the local base model
        released = capture(s)
        run_session(s, "opd", ["[hint yes] use Celsius"])
        wait_scored(s, 2)
        wait_lines(tmp_path, "release", 2)
    score = by_index(tmp_path)[0]
    assert score["votes"] == [] and score["reward"] is None
    (turn,) = [r["turn"] for r in released]
    choice = turn["choices"][0]
    tok = tiny.tokenizer
    hinted = scoring.hinted_messages(turn["messages"], score["hint"])
    prompt = tok.apply_chat_template(hinted, tools=turn["tools"], add_generation_prompt=True)
    assert len(prompt) > len(turn["prompt_ids"])  # the hint is in the teacher's context
    ids = mx.array(prompt + choice["completion_ids"])[None]
    logits = tiny.model(ids)[0, len(prompt) - 1:-1]  # adapter at version 0 == the base
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = mx.take_along_axis(lp, mx.array(choice["completion_ids"])[:, None], axis=1)[:, 0]
    assert mx.allclose(want, mx.array(score["teacher_logprobs"]), atol=1e-4).item()
    assert released[0]["advantages"] == pytest.approx(
        [t - b for t, b in zip(score["teacher_logprobs"], choice["logprobs"])])


@pytest.mark.parametrize("mode,expected", [("override", -0.5), ("add", 0.5)])
def test_feedback_overrides_or_adds(tiny, tmp_path, judge, mode, expected):
    with proxy(tiny, tmp_path, judge, feedback_mode=mode, at_least_one=False) as s:
        released = capture(s)
        run_session(s, "fb", ["[votes 1,1,1] thanks"], done=False)
        # feedback for the pending last turn arrives before it is scored ...
        r = requests.post(s.base_url + "/feedback",
                          json={"session_id": "fb", "turn": "last", "reward": 0.75})
        assert r.json()["status"] == "pending"
        wait_scored(s, 1)
        # ... and for turn 0 after it was scored and released
        r = requests.post(s.base_url + "/feedback",
                          json={"session_id": "fb", "turn_index": 0, "reward": -0.5,
                                "comment": "wrong city"})
        assert r.status_code == 200 and r.json()["status"] == "rescored"
        requests.post(s.base_url + "/sessions/fb/end")
        wait_scored(s, 2)
        wait_for(lambda: len(released) == 3, what="3 released items")
        turn0 = [r for r in released if r["turn"]["index"] == 0]
        # released when scored, and again (to be trained again) with the feedback's reward
        assert [(r["reward"], r["update"]) for r in turn0] == [(1, False), (expected, True)]
        bad = [requests.post(s.base_url + "/feedback", json=b).status_code for b in [
            {"session_id": "fb", "turn": "last", "reward": 2},
            {"session_id": "fb", "reward": 1},
            {"session_id": "nope", "turn": "last", "reward": 1},
            {"session_id": "fb", "turn_uid": 5, "reward": 1},
            {"session_id": "fb", "turn_index": "0", "reward": 1}]]
        assert bad == [400, 400, 404, 400, 400]
    wait_lines(tmp_path, "release", 3)
    releases = [r for r in lines(tmp_path, "release") if r["index"] == 0]
    assert releases[0]["reward"] == 1 and releases[-1]["reward"] == expected
    assert releases[-1]["reason"] == "feedback"
    last = by_index(tmp_path)[1]
    assert last["reward"] == 0.75  # no judge for the last turn: the feedback is the reward


def test_outage_then_recovery_scores_each_waiting_turn_once(tiny, tmp_path, judge):
    judge.down = True
    with proxy(tiny, tmp_path, judge) as s:
        run_session(s, "out", ["[votes 1,1,1] a", "[votes 1,1,1] b", "[votes 1,1,1] c"])
        deadline = time.time() + 15
        while requests.get(s.url + "/healthz").json()["scoring"]["outages"] < 3:
            assert time.time() < deadline
            time.sleep(0.2)
        # only the last turn is scored: it has no next state, so it needs no judge
        assert [r["final"] for r in lines(tmp_path, "score")] == [True]
        judge.down = False
        wait_scored(s, 4, timeout=60)
    uids = [r["uid"] for r in lines(tmp_path, "score")]
    assert len(uids) == 4 and len(set(uids)) == 4


def test_restart_during_outage_loses_no_turn(tiny, tmp_path, judge):
    judge.down = True
    with proxy(tiny, tmp_path, judge) as s:
        run_session(s, "rs", ["[votes 1,1,1] a", "[votes -1,-1,-1] b"])
        # both judged turns met the outage (the judge refused them) and wait for a retry
        wait_for(lambda: requests.get(s.url + "/healthz").json()["scoring"]["outages"] >= 2,
                 what="two outages")
        assert judge.refused >= 2 * 3  # 3 votes each, all refused
        assert requests.get(s.url + "/healthz").json()["scoring"]["pending"] == 2
    assert [r["final"] for r in lines(tmp_path, "score")] == [True]  # judged turns all wait
    assert len(read_records(tmp_path)) == 3
    judge.down = False
    with proxy(tiny, tmp_path, judge) as s:
        wait_scored(s, 2, timeout=60)  # the two that waited; the last was scored before
    scores = by_index(tmp_path)
    assert [scores[i]["judge_reward"] for i in (0, 1)] == [1, -1]
    assert len(lines(tmp_path, "score")) == 3


@pytest.mark.parametrize("verdict", ["votes", "logprob"])
def test_local_judge_leaves_the_serving_adapter_alone(own, tmp_path, verdict):
    before = {k: mx.array(v) for k, v in lora_weights(own.model).items()}
    with ServerThread(make_settings(tmp_path, prm_m=2, prm_verdict=verdict), own) as s:
        run_session(s, "local", ["thanks", "and another"])
        stats = wait_scored(s, 3, timeout=60)
        assert stats["scored"] == 3
        assert s.app[ENGINE].adapter_version == 0
        health = requests.get(s.url + "/healthz").json()
    assert health["adapter_version"] == 0
    for k, v in lora_weights(own.model).items():
        assert mx.array_equal(v, before[k]).item(), k
    scores = [r for r in lines(tmp_path, "score") if r["index"] < 2]
    if verdict == "votes":
        assert all(len(r["votes"]) == 2 for r in scores)
        assert all(v["text"] is not None for r in scores for v in r["votes"])  # it answered
    else:  # one forward pass: both labels' log-probs, read from the full distribution
        assert all(r["votes"] == [] and set(r["verdict"]["label_logprobs"]) == {"1", "-1"}
                   for r in scores)
        assert all(0 < r["verdict"]["p_good"] < 1 for r in scores)




# ---- log-prob verdicts from a judge URL, and what at-least-one may never do ----


def calibrated_prompts(tmp_path, scale: float, bias: float):
    """A copy of prm_prompts/ with a calibration for the judge model named "scripted"."""
    import json
    import shutil

    from rlproxy.settings import PRM_PROMPTS_DIR

    folder = tmp_path / "prompts"
    shutil.copytree(PRM_PROMPTS_DIR, folder)
    config = json.loads((folder / "verdict.json").read_text())
    config["calibration"] = {"scripted": {"scale": scale, "bias": bias}}
    (folder / "verdict.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("shape", ["legacy", "content"])
def test_a_url_judge_gives_calibrated_logprob_verdicts(tiny, tmp_path, shape):
    prompts = calibrated_prompts(tmp_path, scale=2.0, bias=0.5)
    with Judge(shape=shape) as judge, proxy(
            tiny, tmp_path / "data", judge, prm_verdict="logprob", judge_model="scripted",
            prm_prompts=str(prompts), prm_min_margin=0.5, at_least_one=False) as s:
        released = capture(s)
        run_session(s, "lp", ["[verdict -0.1,-2.3] thanks", "[verdict -2.0,-0.05] no, redo",
                              "[verdict -1.0,-1.05] hmm", "[verdict _,-0.2] wrong"])
        # once log-probs came, an answer without them is no verdict for that turn, not a
        # fall-back to votes
        run_session(s, "no-lp", ["plain words"])
        health = wait_scored(s, 7)
        wait_for(lambda: len(released) == 3, what="3 released turns")
    scores = {r["index"]: r for r in lines(tmp_path / "data", "score") if r["session_id"] == "lp"}
    (plain,) = [r for r in lines(tmp_path / "data", "score") if r["session_id"] == "no-lp"
                and r["index"] == 0]
    assert plain["judged"] and plain["verdict"]["decided"] is False and plain["votes"] == []

    def expected(z):  # the expected score 2P - 1 under P = sigmoid(2z + 0.5)
        return 2 / (1 + math.exp(-(2 * z + 0.5))) - 1

    assert scores[0]["judge_reward"] == pytest.approx(expected(2.2), abs=1e-3)
    assert scores[1]["judge_reward"] == pytest.approx(expected(-1.95), abs=1e-3)
    # a margin under --prm-min-margin: undecided, recorded with its figures, not trained
    assert scores[2]["verdict"]["decided"] is False and scores[2]["judge_reward"] is None
    assert scores[2]["verdict"]["margin"] == pytest.approx(abs(expected(0.05)), abs=1e-3)
    assert scores[2]["reward"] is None
    # " worked" not among the top log-probs: it ranks below all of them (the smallest, -5)
    assert scores[3]["judge_reward"] == pytest.approx(expected(-4.8), abs=1e-3)
    assert sorted(r["turn"]["index"] for r in released) == [0, 1, 3]
    assert all(r["votes"] == [] for r in scores.values())
    assert health["verdict"] == "logprob"
    assert health["judge"]["good"] == 1 and health["judge"]["bad"] == 2
    assert health["judge"]["undecided"] == 2 and health["judge"]["undecided_share"] == 0.4
    assert sum(judge.verdicts.values()) == 5  # one call per judged turn: no sampling
    assert sum(judge.calls.values()) == 0  # no votes


def test_a_url_judge_without_logprobs_falls_back_to_votes(tiny, tmp_path, judge, caplog):
    with proxy(tiny, tmp_path, judge, prm_verdict="logprob", at_least_one=False) as s:
        run_session(s, "fb", ["[votes 1,1,1] thanks", "[votes -1,-1,1] no"])
        health = wait_scored(s, 3)
    scores = by_index(tmp_path)
    assert [scores[i]["judge_reward"] for i in (0, 1)] == [1, -1]
    assert all(len(scores[i]["votes"]) == 3 for i in (0, 1))
    assert health["verdict"] == "votes"
    warnings = [r for r in caplog.records if "returns no log-probs" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"


def test_at_least_one_never_flips_feedback_nor_lifts_an_undecided_turn(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge) as s:
        # every turn judged -1, then rated -1 by the user before the session closed
        run_session(s, "rated", ["[votes -1,-1,-1] wrong", "[votes -1,-1,-1] still wrong"],
                    done=False)
        wait_scored(s, 2)
        for index in (0, 1, 2):
            r = requests.post(s.base_url + "/feedback",
                              json={"session_id": "rated", "turn_index": index, "reward": -1})
            assert r.status_code == 200, r.text
        # the judge could not decide any turn
        run_session(s, "unsure", ["[votes garbage,garbage,garbage] hmm",
                                  "[votes 0,0,0] wait", "[votes 1,-1,0] ok"])
        # one turn rated -1, one judged -1: only the judged one may be lifted
        run_session(s, "mixed", ["[votes -1,-1,-1] no", "[votes -1,-1,-1] not that either"],
                    done=False)
        wait_scored(s, 8)  # the open sessions' last turns wait for their close
        requests.post(s.base_url + "/feedback",
                      json={"session_id": "mixed", "turn_index": 0, "reward": -1})
        requests.post(s.base_url + "/sessions/rated/end")
        requests.post(s.base_url + "/sessions/mixed/end")
        health = wait_scored(s, 10)
        wait_lines(tmp_path, "release", 10)
    releases = lines(tmp_path, "release")
    lifted = [(r["session_id"], r["index"]) for r in releases if r["reason"] == "at_least_one"]
    assert lifted == [("mixed", 1)]
    rated = [r for r in releases if r["session_id"] == "rated"]
    assert rated and all(r["reward"] is None or r["reward"] < 0 for r in rated)
    unsure = {r["index"]: r["reward"] for r in releases if r["session_id"] == "unsure"}
    assert unsure == {0: None, 1: None, 2: None, 3: None}
    mixed = {r["index"]: r["reward"] for r in releases if r["session_id"] == "mixed"
             and r["reason"] != "feedback"}
    assert mixed[0] == -1 and mixed[1] == 1.0
    assert health["judge"]["lifted"] == 1 and health["judge"]["undecided"] == 3
    assert health["judge"]["feedback_agree"] == 3  # -1 feedback on turns judged -1


def test_feedback_under_override_is_not_sent_to_the_judge(tiny, tmp_path, judge):
    with proxy(tiny, tmp_path, judge, at_least_one=False) as s:
        messages = [{"role": "user", "content": "Please check the weather."}]
        messages.append(chat(s, "ov", messages))
        r = requests.post(s.base_url + "/feedback",
                          json={"session_id": "ov", "turn": "last", "reward": -1})
        assert r.json()["status"] == "pending"  # turn 0 has no next state yet
        messages.append({"role": "user", "content": "[votes 1,1,1] thanks"})
        chat(s, "ov", messages, **{"X-Session-Done": "1"})
        health = wait_scored(s, 2)
    score = by_index(tmp_path)[0]
    assert score["reward"] == -1 and score["judge_reward"] is None
    assert score["judge_skipped"] is True and score["votes"] == []
    assert sum(judge.calls.values()) == 0
    assert health["judge"]["skipped"] == 1


# ---- bounded memory, and the records read back (the Scorer alone, no server) ----


def minus_one(turn, next_state):
    return -1.0


def fake_turn(session: str, index: int, final: bool) -> dict:
    return {"kind": "turn", "uid": f"{session}-{index}", "session_id": session, "index": index,
            "trainable": True, "messages": [{"role": "user", "content": "hi"}], "tools": None,
            "prompt_ids": list(range(1000, 1100)), "chosen_choice": 0,
            "choices": [{"completion_ids": [5, 6], "logprobs": [-1.0, -2.0], "text": "x",
                         "tool_calls": []}],
            "next_state": None if final else [{"role": "user", "content": "ok"}],
            "end": "session_done" if final else None}


async def test_the_scorer_forgets_finished_sessions_and_reads_its_records_back(tmp_path):
    from rlproxy.paths import CONVERSATIONS
    from rlproxy.records import JsonlWriter
    from rlproxy.recovery import recover
    from rlproxy.scoring.scorer import Scorer, ScorerStart

    settings = make_settings(tmp_path, judge=False, reward_functions=["test_scoring:minus_one"])
    turns = JsonlWriter(tmp_path / CONVERSATIONS, fsync=False)
    scorer = Scorer(settings.scoring, tmp_path, None, None, None,
                    ScorerStart.fresh(settings.scoring, keep_recent=3, keep_scored=8),
                    fsync=False)
    released: list[dict] = []
    scorer.on_released = released.append
    task = asyncio.create_task(scorer.run())
    try:
        for k in range(20):  # 20 sessions of 2 turns, all -1: each lifts its last turn
            for i in range(2):
                record = fake_turn(f"s{k}", i, final=i == 1)
                await turns.write_async(record)
                scorer.submit(record)
                scorer.submit(record)  # a duplicate: scored once
        deadline = time.time() + 30
        while scorer.pending or len(released) < 40:
            assert time.time() < deadline, scorer.stats
            await asyncio.sleep(0.02)
        assert scorer.stats.scored == 40 and len(released) == 40
        # a reward function's -1 is a verifier's word: at-least-one never lifts it
        assert [r["reward"] for r in released if r["turn"]["index"] == 1] == [-1.0] * 20
        # nothing of a finished session is kept but the bounded remainders
        assert scorer.ledger.tallies == {} and scorer.held == {}
        assert list(scorer.recent) == ["s18-1", "s19-0", "s19-1"]
        assert len(scorer.summaries) == 8 and len(scorer.known) == 8
        # feedback: a recent turn is trained again; an older one only re-released
        assert await scorer.add_feedback("s19-0", "s19", 0.5, None) == "rescored"
        assert released[-1]["update"] and released[-1]["key"] == "s19-0"
        assert await scorer.add_feedback("s17-0", "s17", 0.5, None) == "rescored"
        assert len(released) == 41
        assert await scorer.add_feedback("s1-0", "s1", 0.5, None) == "pending"  # forgotten
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        scorer.close()
        turns.close()
    again = lines(tmp_path, "release")
    assert [(r["uid"], r["reward"], r["reason"]) for r in again[-2:]] == [
        ("s19-0", 0.5, "feedback"), ("s17-0", 0.5, "feedback")]
    # a restart: nothing is scored or released twice, and the latest turns are at hand again
    scorer = Scorer(settings.scoring, tmp_path, None, None, None,
                    recover(tmp_path, settings, keep_recent=3, keep_scored=8).scorer,
                    fsync=False)
    try:
        assert scorer.queue.empty() and scorer.pending == 0 and scorer.ledger.tallies == {}
        assert set(scorer.recent) == {"s18-1", "s19-0", "s19-1"}
        assert scorer.ledger.done.peek("s19-0") == 0.5 and scorer.ledger.done.peek("s17-0") == 0.5
        assert scorer.health()["judge"]["released"] == 40  # read back from the records
        assert scorer.ledger.settle() == []
    finally:
        scorer.close()


def test_feedback_read_back_is_never_lifted_and_keeps_its_reward(tmp_path):
    """A restart reads feedback back whatever its order against the score line: here turn 0's
    feedback line was written while its score line (without it) was being written. Neither
    rated turn may be lifted, and the held turn is released with the feedback's reward."""
    import orjson

    from rlproxy.paths import SCORES
    from rlproxy.recovery import recover
    from rlproxy.scoring.ledger import Release
    from rlproxy.scoring.scorer import Scorer

    def score(uid, index, judge, final):
        return {"kind": "score", "uid": uid, "session_id": "s", "index": index, "reward": judge,
                "final": final, "judge_reward": judge, "function_reward": None,
                "feedback": None, "judged": True}

    lines_ = [{"kind": "feedback", "uid": "a0", "session_id": "s", "reward": -1.0},
              score("a0", 0, -0.5, False), score("a1", 1, -1.0, True),
              {"kind": "feedback", "uid": "a1", "session_id": "s", "reward": -1.0}]
    (tmp_path / SCORES).write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines_))
    settings = make_settings(tmp_path)
    scorer = Scorer(settings.scoring, tmp_path, None, None, None,
                    recover(tmp_path, settings).scorer, fsync=False)
    try:
        assert scorer.ledger.settle() == [Release("a0", -1.0, "session_closed"),
                                          Release("a1", -1.0, "session_closed")]
        assert scorer.health()["judge"]["feedback_agree"] == 2  # read back too
    finally:
        scorer.close()


def test_local_verdicts_are_exact_and_independent(tiny):
    """The local judge reuses the few-shot head's KV: verdicts A, B, A read exactly what one
    plain forward pass of each whole prompt reads, so no verdict leaks into the next."""
    from rlproxy.scoring.judges import LocalJudge
    from rlproxy.settings import PRM_PROMPTS_DIR

    prompts = scoring.load_prompts(PRM_PROMPTS_DIR)
    words = list(prompts["verdict_json"]["labels"])
    turns = [{"messages": [{"role": "user", "content": "hi"}],
              "choices": [{"text": "hello", "tool_calls": []}],
              "next_state": [{"role": "user", "content": text}]}
             for text in ("Thanks, perfect.", "No. " * 60 + "Redo it.")]
    texts = [scoring.fill_verdict_prompt(prompts["verdict_txt"], t, 4000) for t in turns]
    judge = LocalJudge(tiny.model, tiny.tokenizer, yield_ms=0)
    try:
        got = [asyncio.run(judge.verdict(texts[k], words)) for k in (0, 1, 0)]
        assert judge._head is not None  # the head was reused
    finally:
        judge.close()
    assert got[0] == got[2] and got[0] != got[1]
    for text, top in zip(texts, got[:2]):
        logits = tiny.model(mx.array(tiny.tokenizer.encode(text))[None])[0, -1]
        lp = logits - mx.logsumexp(logits)
        for spelling, value in top.items():
            token = tiny.tokenizer.encode(spelling, add_special_tokens=False)[0]
            assert value == pytest.approx(lp[token].item(), abs=1e-4), spelling

