"""Scoring against the next state: the math, and real sessions through the proxy judged by a small
real aiohttp judge server (the one narrow fake: its verdicts are scripted by the test). What the
trainer would be handed is captured by setting the scorer's `on_released` (--no-train: nothing
else reads it). Tests wait on conditions (/healthz, lines on disk), never on a fixed sleep."""

from __future__ import annotations

import asyncio
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


# ---- a scripted judge on a real port ----


class Judge:
    """Answers /v1/chat/completions. The next state of the judged turn carries the script:
    `[votes 1,-1,garbage,timeout]` (the k-th call for that turn gets the k-th item) and
    `[hint yes]` (hint prompts get a hint). `down` makes every call a 503 (an outage)."""

    def __init__(self):
        self.down = False
        self.refused = 0  # calls answered 503 while down
        self.calls: Counter = Counter()
        self.thread = AppThread(self._app)

    def _app(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

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
    settings = make_settings(tmp_path, judge_url=judge.url, judge_timeout_s=1.0,
                             judge_retries=1, **flags)
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
    assert [scores[i]["judge_reward"] for i in range(5)] == [1, 0, -1, 1, 0]
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
    assert releases[("neg", 1)]["reward"] == 1.0 and releases[("neg", 1)]["reason"] == "at_least_one"
    assert releases[("neg", 0)]["reward"] == -1 and releases[("neg", 2)]["reward"] == -1
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


def test_local_judge_leaves_the_serving_adapter_alone(tmp_path):
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings

    own = load_serving_model(ModelSettings(model="tiny"))  # this test's own copy: weights are compared
    before = {k: mx.array(v) for k, v in lora_weights(own.model).items()}
    with ServerThread(make_settings(tmp_path, prm_m=2), own) as s:
        run_session(s, "local", ["thanks", "and another"])
        stats = wait_scored(s, 3, timeout=60)
        assert stats["scored"] == 3
        assert s.app[ENGINE].adapter_version == 0
        health = requests.get(s.url + "/healthz").json()
    assert health["adapter_version"] == 0
    for k, v in lora_weights(own.model).items():
        assert mx.array_equal(v, before[k]).item(), k
    scores = lines(tmp_path, "score")
    assert all(len(r["votes"]) == 2 for r in scores if r["index"] < 2)
    assert all(v["text"] is not None for r in scores for v in r["votes"])  # the model answered




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
    from rlproxy.scoring.scorer import Scorer

    settings = make_settings(tmp_path, judge=False, reward_functions=["test_scoring:minus_one"])
    turns = JsonlWriter(tmp_path / CONVERSATIONS, fsync=False)
    scorer = Scorer(settings.scoring, tmp_path, None, None, None, fsync=False,
                    keep_recent=3, keep_scored=8)
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
        assert [r["reward"] for r in released if r["turn"]["index"] == 1] == [1.0] * 20
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
    scorer = Scorer(settings.scoring, tmp_path, None, None, None, fsync=False,
                    keep_recent=3, keep_scored=8)
    try:
        assert scorer.queue.empty() and scorer.pending == 0 and scorer.ledger.tallies == {}
        assert set(scorer.recent) == {"s18-1", "s19-0", "s19-1"}
        assert scorer.ledger.done.peek("s19-0") == 0.5 and scorer.ledger.done.peek("s17-0") == 0.5
        assert scorer.ledger.settle() == []
    finally:
        scorer.close()
