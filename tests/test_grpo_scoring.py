"""Group baselines (GRPO) and reward functions off the event loop: the math by hand, the reward
function runner on real threads, and requests with n > 1 through the real proxy, judged by a
small real aiohttp judge whose verdict depends on the choice it is shown."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import requests
from aiohttp import web

from rlproxy.appkeys import SCORER
from rlproxy.scoring import judging as scoring
from rlproxy.scoring.rewards import RewardFunctions
from conftest import AppThread, ServerThread, make_settings, read_records

# ---- group advantages by hand: a group of 4 ----

STD = math.sqrt((0.875 ** 2 + 0.125 ** 2 + 1.125 ** 2 + 0.375 ** 2) / 3)  # sample std of below


def test_group_of_four_subtracts_the_mean_with_dr_grpo():
    # rewards 1, 0, -1, 0.5: mean 0.125; --baseline group: no division
    assert scoring.group_baseline([1.0, 0.0, -1.0, 0.5], "group") == (0.125, None)
    assert scoring.group_advantages([1.0, 0.0, -1.0, 0.5], "group") == [0.875, -0.125, -1.125,
                                                                         0.375]


@pytest.mark.parametrize("mode", ["group-std", "mean", "none"])
def test_group_of_four_divided_by_its_std(mode):
    # every other baseline (mean is the default) divides a group by its std, never below the
    # floor; std 0.854 is above the floor (0.1): divided by the std itself
    assert scoring.group_baseline([1.0, 0.0, -1.0, 0.5], mode) == pytest.approx((0.125, STD))
    assert scoring.group_advantages([1.0, 0.0, -1.0, 0.5], mode) == pytest.approx(
        [0.875 / STD, -0.125 / STD, -1.125 / STD, 0.375 / STD])
    assert 0.8539 < STD < 0.8540


@pytest.mark.parametrize("mode", ["group", "group-std"])
def test_a_zero_std_group_has_exactly_zero_advantages(mode):
    assert scoring.group_advantages([0.3, 0.3, 0.3, 0.3], mode) == [0.0, 0.0, 0.0, 0.0]
    assert scoring.group_baseline([0.3, 0.3, 0.3, 0.3], mode) == (0.3, None)


def test_an_unscored_choice_is_left_out_of_the_group():
    # [1, -, 0, -1]: mean 0, sample std 1
    assert scoring.group_advantages([1.0, None, 0.0, -1.0], "group") == [1.0, None, 0.0, -1.0]
    assert scoring.group_advantages([1.0, None, 0.0, -1.0], "group-std") == pytest.approx(
        [1.0, None, 0.0, -1.0])
    # one scored choice is no group: not baselined here (the trainer's --baseline applies)
    assert scoring.group_baseline([None, 1.0, None, None], "group") == (None, None)
    assert scoring.group_advantages([None, 1.0, None, None], "group-std") == [None, 1.0, None,
                                                                              None]


def score_line(**kw) -> dict:
    line = {"kind": "score", "uid": "u", "session_id": "s", "index": 0, "chosen_choice": 2,
            "reward": 0.5, "judge_reward": None, "function_reward": 0.5,
            "teacher_logprobs": None,
            "other_choices": [{"choice": 0, "reward": 1.0, "teacher_logprobs": None},
                              {"choice": 1, "reward": 0.0, "teacher_logprobs": None},
                              {"choice": 3, "reward": None, "teacher_logprobs": None}]}
    return {**line, **kw}


def test_release_lines_and_items_of_a_group():
    line = score_line()
    out = scoring.release_lines(line, 4, 0.5, "scored", "group", with_others=True)
    # choice 3 has nothing to train; the chosen choice's line comes last; mean of 1, 0, .5
    assert [(r["choice"], r["key"], r["reason"]) for r in out] == [
        (0, "u/0", "group"), (1, "u/1", "group"), (2, "u", "scored")]
    assert all(r["baseline"] == pytest.approx(0.5) and r["scale"] is None for r in out)
    turn = {"uid": "u", "chosen_choice": 2,
            "choices": [{"logprobs": [-1.0, -2.0]} for _ in range(4)]}
    items = [scoring.released_item(turn, line, r, w_opd=1.0, w_rl=2.0) for r in out]
    assert [i["advantages"] for i in items] == [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]
    assert [i["key"] for i in items] == ["u/0", "u/1", "u"]
    assert all(i["baselined"] and not i["update"] for i in items)
    # at-least-one lifted the chosen choice to +1: the baseline is over what is released
    lifted = scoring.release_lines(line, 4, 1.0, "at_least_one", "group", with_others=True)
    assert lifted[-1]["reward"] == 1.0 and lifted[-1]["baseline"] == pytest.approx(2 / 3)
    # feedback re-releases the chosen choice only, against the group's other rewards
    (again,) = scoring.release_lines(line, 4, -1.0, "feedback", "group", with_others=False)
    assert again["key"] == "u" and again["baseline"] == pytest.approx(0.0)


def test_teacher_logprobs_of_each_choice_and_a_lone_choice():
    line = score_line(method="opd", reward=None, teacher_logprobs=[-0.5, -1.5],
                      other_choices=[{"choice": i, "reward": None, "teacher_logprobs":
                                      [-1.0, -1.0] if i == 0 else None} for i in (0, 1, 3)])
    out = scoring.release_lines(line, 4, None, "scored", "group-std", with_others=True)
    assert [r["key"] for r in out] == ["u/0", "u"]  # only choices with a teacher
    turn = {"uid": "u", "chosen_choice": 2,
            "choices": [{"logprobs": [-1.0, -2.0]} for _ in range(4)]}
    items = [scoring.released_item(turn, line, r, w_opd=1.0, w_rl=1.0) for r in out]
    assert items[0]["advantages"] == [0.0, 1.0] and items[1]["advantages"] == [0.5, 0.5]
    assert not any(i["baselined"] for i in items)
    # n = 1, and a release line written before choices existed: rebuilt the same way
    lone = {"uid": "v", "choices": [{"logprobs": [-1.0]}]}
    item = scoring.released_item(lone, {"teacher_logprobs": None},
                                 {"reward": -1.0, "reason": "scored"}, 1.0, 0.5)
    assert item["key"] == "v" and item["choice"] == 0 and item["advantages"] == [-0.5]
    assert item["baselined"] is False


# ---- reward functions on worker threads ----

RELEASE = threading.Event()  # a hanging function waits on it; set when a test is done


def new_style(turn, next_state, choice):
    return [1.0, -1.0][choice]


def old_style(turn, next_state):
    return turn["choices"][turn["chosen_choice"]]["value"]


def slow(turn, next_state, choice=0):
    time.sleep(3.0)
    return 1.0


def hangs(turn, next_state):
    RELEASE.wait(60)
    return 1.0


def raises(turn, next_state):
    raise ValueError("no such city")


def nan(turn, next_state):
    return float("nan")


def words(turn, next_state):
    return "great"


def none(turn, next_state):
    return None


def huge(turn, next_state, choice):
    return 7


TURN = {"uid": "t", "chosen_choice": 1, "next_state": [{"role": "user", "content": "ok"}],
        "choices": [{"value": 0.25}, {"value": -0.75}]}


def names(*fns):
    return [f"test_grpo_scoring:{fn.__name__}" for fn in fns]


async def test_old_and_new_signatures_and_the_first_answer_wins():
    rewards, errors = await RewardFunctions(names(none, new_style), 5).score(TURN, [0, 1])
    assert rewards == {0: 1.0, 1: -1.0} and errors == []
    rewards, _ = await RewardFunctions(names(old_style), 5).score(TURN, [0, 1])
    assert rewards == {0: 0.25, 1: -0.75}  # a 2-argument function sees the choice as chosen
    assert TURN["chosen_choice"] == 1  # ... on a copy
    rewards, _ = await RewardFunctions(names(huge), 5).score(TURN, [0])
    assert rewards == {0: 1.0}  # clipped


async def test_failing_functions_are_recorded_and_the_next_one_used():
    fns = RewardFunctions(names(raises, nan, words, slow, new_style), timeout_s=1.0)
    rewards, errors = await fns.score(TURN, [0, 1])
    assert rewards == {0: 1.0, 1: -1.0}
    got = {(e["choice"], e["function"].split(":")[1]): e["error"] for e in errors}
    assert got[(0, "raises")] == "ValueError: no such city"
    assert "NaN" in got[(0, "nan")] and "'great', not a number" in got[(1, "words")]
    assert got[(1, "slow")].startswith("TimeoutError: no answer within 1 s")
    assert len(errors) == 8


async def test_a_hanging_function_never_blocks_the_loop_and_cannot_pile_up_threads():
    fns = RewardFunctions(names(hangs), timeout_s=0.2, max_running=2)
    ticks, stop = [], asyncio.Event()

    async def ticker():  # the event loop's own latency while the function hangs
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            ticks.append(time.perf_counter() - t)

    tick = asyncio.create_task(ticker())
    RELEASE.clear()
    try:
        started = time.perf_counter()
        rewards, errors = await fns.score(TURN, [0, 1])  # two calls at once, both overrun
        assert time.perf_counter() - started < 5.0
        assert rewards == {0: None, 1: None}
        assert all("no answer within 0.2 s (" in e["error"] for e in errors)
        rewards, errors = await fns.score(TURN, [0, 1, 0])  # both slots still taken
        assert rewards == {0: None, 1: None}
        assert all("2 earlier calls are still running" in e["error"] for e in errors)
        hung = [t for t in threading.enumerate() if t.name == "reward-" + names(hangs)[0]]
        assert len(hung) == 2  # no thread started without a slot
    finally:
        RELEASE.set()
        stop.set()
        await tick
    assert max(ticks) < 1.0  # on the loop it would take 60 s (loose: a shared CPU)
    rewards, _ = await fns.score(TURN, [0])  # the late calls ended: their slots are free
    assert rewards == {0: 1.0}


# ---- n > 1 through the proxy ----


def by_choice(turn, next_state, choice):
    """The reward function the proxy tests load: the reward is decided by the choice."""
    return [-1.0, 0.0, 0.5, 1.0][choice]


class ChoiceJudge:
    """Votes +1 for an assistant output that contains one of `good`, else -1; hint prompts get a
    hint. The votes depend on the choice shown, so a test knows each choice's judge reward."""

    def __init__(self):
        self.good: list[str] = []
        self.outputs: list[str] = []
        self.thread = AppThread(self._app)

    def _app(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _chat(self, request):
        prompt = (await request.json())["messages"][0]["content"]
        if "[HINT_START]" in prompt:
            text = "[HINT_START]Answer in one word.[HINT_END]"
        else:
            shown = prompt.split("## The assistant's output at this step\n", 1)[1]
            shown = shown.split("\n\n## What came next", 1)[0]
            self.outputs.append(shown)
            text = r"\boxed{1}" if any(g in shown for g in self.good) else r"\boxed{-1}"
        return web.json_response({"choices": [{"message": {"content": text}}]})

    @property
    def url(self):
        return self.thread.url + "/v1"


@pytest.fixture(scope="module")
def choice_judge():
    judge = ChoiceJudge()
    with judge.thread:
        yield judge


def serve(tiny, tmp_path, **flags):
    """The judge here votes (the scripted judge answers chat completions only)."""
    return ServerThread(make_settings(tmp_path, **{"prm_verdict": "votes", **flags}), tiny)


def capture(server) -> list[dict]:
    released: list[dict] = []
    server.app[SCORER].on_released = released.append  # what the trainer would be handed
    return released


def wait_for(condition, timeout=30.0, what="condition"):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def group_turn(server, sid, n=4, seed=3, then=None):
    """One request with n choices, continued from a choice whose text no other choice has,
    then a last request that ends the session. Returns (texts, chosen)."""
    c, h = server.client(), {"X-Session-Id": sid}
    messages = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model="m", messages=messages, max_tokens=4, n=n, seed=seed,
                                  extra_headers=h)
    texts = [ch.message.content for ch in r.choices]
    chosen = next(i for i in reversed(range(n)) if texts.count(texts[i]) == 1)
    if then is not None:
        then(texts, chosen)
    messages += [{"role": "assistant", "content": texts[chosen]},
                 {"role": "user", "content": "thanks"}]
    c.chat.completions.create(model="m", messages=messages, max_tokens=4,
                              extra_headers={**h, "X-Session-Done": "1"})
    return texts, chosen


def first_score(data_dir) -> dict:
    """The score line of the session's first turn (the group)."""
    return next(r for r in read_records(data_dir, "prm_scores.jsonl")
                if r["kind"] == "score" and r["index"] == 0)


def releases(data_dir) -> list[dict]:
    return [r for r in read_records(data_dir, "prm_scores.jsonl") if r["kind"] == "release"]


def test_every_choice_is_recorded_scored_and_released_with_its_group_baseline(tiny, tmp_path):
    with serve(tiny, tmp_path, judge=False, reward_functions=["test_grpo_scoring:by_choice"],
               at_least_one=False, baseline="group") as s:  # Dr. GRPO: exact by hand
        released = capture(s)
        texts, chosen = group_turn(s, "grpo")
        wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 5, what="5 releases")
    record = read_records(tmp_path)[0]
    assert len(record["choices"]) == 4 and record["chosen_choice"] == chosen
    assert [c["text"] for c in record["choices"]] == texts
    score = first_score(tmp_path)
    assert score["chosen_choice"] == chosen and score["function_errors"] == []
    assert {o["choice"]: o["reward"] for o in score["other_choices"]} == {
        i: [-1.0, 0.0, 0.5, 1.0][i] for i in range(4) if i != chosen}
    group = [r for r in released if r["turn"]["index"] == 0]
    uid = record["uid"]
    assert sorted(r["key"] for r in group) == sorted(
        uid if i == chosen else f"{uid}/{i}" for i in range(4))
    for item in group:  # r - mean(-1, 0, .5, 1) = r - 0.125, on every completion token
        i = item["choice"]
        assert item["baselined"] and item["reward"] == [-1.0, 0.0, 0.5, 1.0][i]
        n_tokens = len(record["choices"][i]["completion_ids"])
        assert item["advantages"] == [[-1.0, 0.0, 0.5, 1.0][i] - 0.125] * n_tokens
    lines = [r for r in releases(tmp_path) if r["index"] == 0]
    assert {(r["choice"], r["key"], r["baseline"]) for r in lines} == {
        (i["choice"], i["key"], 0.125) for i in group}
    assert lines[-1]["key"] == uid and lines[-1]["reason"] == "scored"
    last = next(r for r in released if r["turn"]["index"] == 1)  # n = 1: the trainer baselines
    assert last["baselined"] is False and last["key"] == last["turn"]["uid"]


def test_the_judge_scores_every_choice_and_at_least_one_lifts_only_the_chosen(
        tiny, tmp_path, choice_judge):
    with serve(tiny, tmp_path, judge_url=choice_judge.url, judge_timeout_s=5.0, prm_m=1,
               score_all_choices=True) as s:
        released = capture(s)
        s.app[SCORER].baseline = "group-std"  # the lead wires settings.trainer.baseline here

        def good(texts, chosen):  # the judge likes one choice that is not the chosen one
            other = next(i for i in range(len(texts)) if i != chosen and texts[i]
                         and not any(texts[i] in t for t in texts[:i] + texts[i + 1:]))
            choice_judge.good[:] = [texts[other]]

        texts, chosen = group_turn(s, "judged", then=good)
        wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 4, what="4 releases")
    score = first_score(tmp_path)
    judged = {chosen: score["judge_reward"],
              **{o["choice"]: o["judge_reward"] for o in score["other_choices"]}}
    assert judged == {i: 1 if texts[i] == choice_judge.good[0] else -1 for i in range(4)}
    assert all(len(o["votes"]) == 1 for o in score["other_choices"])
    # the chosen choice scored -1 and nothing in the session did better: it is lifted to +1
    # (the others keep their own rewards), and the group is [-1, 1, 1, -1] in some order
    items = {r["choice"]: r for r in released if r["turn"]["index"] == 0}
    assert items[chosen]["reward"] == 1.0 and items[chosen]["key"] == score["uid"]
    expected = 1 / math.sqrt(4 / 3)  # (r - 0) / max(sample std, floor 0.1)
    for i, item in items.items():
        sign = 1 if i == chosen or texts[i] == choice_judge.good[0] else -1
        assert item["advantages"][0] == pytest.approx(sign * expected)
    lines = [r for r in releases(tmp_path) if r["index"] == 0]
    assert [r["reason"] for r in lines] == ["group"] * 3 + ["at_least_one"]
    assert all(r["baseline"] == 0.0 and r["scale"] == pytest.approx(expected ** -1)
               for r in lines)


def test_without_score_all_choices_the_judge_sees_only_the_chosen(tiny, tmp_path,
                                                                  choice_judge):
    choice_judge.outputs.clear()
    choice_judge.good.clear()
    with serve(tiny, tmp_path, judge_url=choice_judge.url, judge_timeout_s=5.0, prm_m=1,
               at_least_one=False) as s:
        released = capture(s)
        texts, chosen = group_turn(s, "chosen-only")
        wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 1, what="a release")
        time.sleep(0.2)  # nothing else may follow
    assert len(choice_judge.outputs) == 1 and texts[chosen] in choice_judge.outputs[0]
    (item,) = released  # the chosen choice only; its lone reward is not baselined here
    assert item["choice"] == chosen and item["baselined"] is False
    score = first_score(tmp_path)
    assert all(o["reward"] is None for o in score["other_choices"])


def test_feedback_on_a_group_retrains_the_chosen_choice_only(tiny, tmp_path):
    with serve(tiny, tmp_path, judge=False, reward_functions=["test_grpo_scoring:by_choice"],
               at_least_one=False, baseline="group") as s:  # Dr. GRPO: exact by hand
        released = capture(s)
        texts, chosen = group_turn(s, "fb")
        wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 5, what="5 releases")
        r = requests.post(s.base_url + "/feedback",
                          json={"session_id": "fb", "turn_index": 0, "reward": -1.0})
        assert r.status_code == 200 and r.json()["status"] == "rescored"
        wait_for(lambda: len(released) == 6, what="the re-release")
    again = released[-1]
    assert again["update"] and again["choice"] == chosen and again["reward"] == -1.0
    rewards = [-1.0, 0.0, 0.5, 1.0]
    rewards[chosen] = -1.0
    assert again["advantages"][0] == pytest.approx(-1.0 - sum(rewards) / 4)


def test_opd_scores_every_choice_under_the_same_hint(tiny, tmp_path, choice_judge):
    with serve(tiny, tmp_path, method="opd", judge_url=choice_judge.url,
               judge_timeout_s=5.0, prm_m=1, score_all_choices=True) as s:
        released = capture(s)
        texts, chosen = group_turn(s, "opd", n=2)
        wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 2, what="2 releases")
    score = first_score(tmp_path)
    assert score["hint"] == "Answer in one word." and score["reward"] is None
    record = read_records(tmp_path)[0]
    for item in released:
        teacher = scoring.choice_teacher_logprobs(score, item["choice"])
        behaviour = record["choices"][item["choice"]]["logprobs"]
        assert len(teacher) == len(behaviour) and not item["baselined"]
        assert item["advantages"] == pytest.approx([t - b for t, b in zip(teacher, behaviour)])


def test_a_hanging_reward_function_is_recorded_and_serving_goes_on(tiny, tmp_path):
    HANG.clear()
    with serve(tiny, tmp_path, judge=False, reward_timeout_s=0.5, at_least_one=False,
               reward_functions=["test_grpo_scoring:hang_then_none",
                                 "test_grpo_scoring:by_choice"]) as s:
        released = capture(s)
        try:
            texts, chosen = group_turn(s, "hang", n=2)
            latencies = []
            for _ in range(10):  # the loop answers while the functions hang
                t = time.perf_counter()
                assert requests.get(s.url + "/healthz").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.05)
            wait_for(lambda: s.app[SCORER].pending == 0 and len(released) == 3,
                     what="3 releases")
        finally:
            HANG.set()
    assert max(latencies) < 2.0  # on the loop, the hang would take 30 s (loose: a shared CPU)
    score = first_score(tmp_path)
    errors = score["function_errors"]
    assert {e["choice"] for e in errors} == {0, 1}
    assert all(e["function"] == "test_grpo_scoring:hang_then_none"
               and "no answer within 0.5 s" in e["error"] for e in errors)
    assert score["reward"] == [-1.0, 0.0][chosen]  # the next function answered


HANG = threading.Event()  # hang_then_none waits on it


def hang_then_none(turn, next_state):
    HANG.wait(30)
    return None
