"""Agents' own control notes are not next states, and a reply cut at its budget is not judged
(issue 41; scoring/notes.py). Hermes Agent answers a reply cut at its completion budget with
"[System: Your previous response was truncated ...]" and asks again: replayed here through the
real app on a real port with the real openai SDK, judged by test_scoring's scripted judge on a
real port, which records every prompt it is shown."""

from __future__ import annotations

import pytest
import requests

from conftest import read_records
from rlproxy.appkeys import MODEL
from rlproxy.scoring import judging
from rlproxy.scoring.notes import cut, note_rule, without_notes
from rlproxy.settings import PRM_PROMPTS_DIR
from test_scoring import Judge, capture, lines, proxy, wait_for, wait_scored

# hermes-agent 0.19.0, agent/conversation_loop.py `_get_continuation_prompt` and its nudges,
# agent/conversation_compression.py `_SYNTHETIC_USER_PREFIXES`, word for word
TRUNCATED = ("[System: Your previous response was truncated by the output length limit. "
             "Continue exactly where you left off. Do not restart or repeat prior text. "
             "Finish the answer directly.]")
HERMES_NOTES = [
    TRUNCATED,
    "[System: The previous response was cut off by a network error mid-stream. Continue exactly "
    "where you left off. Do not restart or repeat prior text. Finish the answer directly.]",
    "[System: Your previous tool call (write_file) was too large and the stream timed out "
    "before it could be delivered. Do NOT retry the same tool call with the same large content."
    " Instead, break the content into multiple smaller tool calls (e.g. use multiple patch "
    "calls or write smaller files). Each tool call's arguments must be under ~8K tokens to "
    "avoid stream timeouts.]",
    "[System: Your previous response contained only internal reasoning and never produced a "
    "visible answer or tool call. Do not keep thinking. Produce your final answer as plain text "
    "now (or make the tool call you were planning).]",
    "[Your active task list was preserved across context compression]",
]
CLAUDE_REMINDER = ("<system-reminder>\nThe TodoWrite tool hasn't been used recently.\n"
                   "</system-reminder>")
NOT_NOTES = [
    {"role": "user", "content": "Thanks, that works."},
    {"role": "user", "content": "The [System: ...] banner still shows, fix it."},
    {"role": "user", "content": CLAUDE_REMINDER + "\nNow run the tests please."},
    {"role": "tool", "content": TRUNCATED},  # what a tool printed is the environment's
    {"role": "assistant", "content": TRUNCATED},
]


@pytest.mark.parametrize("text", HERMES_NOTES + [CLAUDE_REMINDER, "  " + CLAUDE_REMINDER * 2])
def test_the_rules_know_the_agents_notes(text):
    assert note_rule({"role": "user", "content": text}) is not None


@pytest.mark.parametrize("message", NOT_NOTES, ids=lambda m: m["content"][:24])
def test_what_users_and_tools_say_is_no_note(message):
    assert note_rule(message) is None


def test_the_judge_reads_neither_notes_nor_a_note_as_the_request():
    request = {"role": "user", "content": "Write a script that prints the first 20 primes."}
    turn = {"messages": [request, {"role": "assistant", "content": "def primes("},
                         {"role": "user", "content": TRUNCATED}],
            "choices": [{"text": "n): ...", "tool_calls": [], "finish_reason": "stop"}],
            "next_state": [{"role": "tool", "content": "2 3 5 7"},
                           {"role": "user", "content": CLAUDE_REMINDER}]}
    prompts = judging.load_prompts(PRM_PROMPTS_DIR)
    votes = judging.fill_prompt(prompts["judge_txt"], turn, 4000)
    verdict = judging.fill_verdict_prompt(prompts["verdict_txt"], turn, 4000)
    assert "first 20 primes" in votes  # the verdict prompt shows no request
    for prompt in (votes, verdict):
        assert "2 3 5 7" in prompt
        assert "[System:" not in prompt and "system-reminder" not in prompt
    assert cut(turn, 0) is None
    turn["next_state"] = [{"role": "user", "content": TRUNCATED}]
    assert cut(turn, 0) == "agent_note" and without_notes(turn["next_state"]) == []
    turn["choices"][0]["finish_reason"] = "length"
    assert cut(turn, 0) == "length" and cut(turn, 0, judge_cut_turns=True) == "agent_note"


def no_eos(server) -> dict:
    return {str(t): -100 for t in server.app[MODEL].tokenizer.eos_token_ids}


def hermes_loop(server, sid: str) -> None:
    """Hermes Agent's truncation loop, as it sends it: a reply cut at its budget, the agent's
    note, the continuation, then the user's real reply, and the session's end."""
    c = server.client()
    messages = [{"role": "user", "content": "Write a script that prints the first 20 primes."}]
    for after in (TRUNCATED, "[votes 1,1,1] Thanks, it runs."):
        r = c.chat.completions.create(model="hermes", messages=messages, max_tokens=4, seed=1,
                                      logit_bias=no_eos(server),
                                      extra_headers={"X-Session-Id": sid})
        assert r.choices[0].finish_reason == "length"
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": after}]
    c.chat.completions.create(model="hermes", messages=messages, max_tokens=2,
                              extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})


def scores(data_dir) -> dict[int, dict]:
    return {ln["index"]: ln for ln in lines(data_dir, "score")}


def test_a_hermes_truncation_loop_judges_no_note_and_no_cut_reply(tiny, tmp_path):
    """By default neither cut reply is judged (`cut: length`), and the judge is never shown the
    note; feedback, a rule of the user's, still trains one."""
    with Judge() as judge, proxy(tiny, tmp_path, judge, judge_cut_turns=False,
                                 at_least_one=False) as s:
        released = capture(s)
        hermes_loop(s, "hermes")
        wait_scored(s, 3)
        got = scores(tmp_path)
        assert [got[i]["cut"] for i in (0, 1)] == ["length", "length"]
        assert [got[i]["judged"] for i in (0, 1)] == [False, False]
        assert [got[i]["reward"] for i in (0, 1)] == [None, None]
        assert not any("[System:" in prompt for prompt in judge.calls)
        assert released == []  # nothing to train on
        r = requests.post(s.base_url + "/feedback", json={
            "session_id": "hermes", "turn_index": 0, "reward": -1.0})
        assert r.json()["status"] == "rescored"
        wait_for(lambda: [x["turn"]["index"] for x in released] == [0], what="the release")
        assert released[0]["reward"] == -1.0


def test_a_next_state_of_notes_only_leaves_the_turn_unjudged(tiny, tmp_path):
    """With --judge-cut-turns the cut replies are judged, but not on the agent's note: the turn
    the note followed is `cut: agent_note`, and the continuation is judged on the user's reply,
    with the user's own request, not the note, shown as what was asked."""
    with Judge() as judge, proxy(tiny, tmp_path, judge, judge_cut_turns=True,
                                 at_least_one=False) as s:
        hermes_loop(s, "hermes")
        wait_scored(s, 3)
        got = scores(tmp_path)
        assert (got[0]["cut"], got[0]["judged"], got[0]["judge_reward"]) == (
            "agent_note", False, None)
        assert (got[1]["cut"], got[1]["judged"], got[1]["judge_reward"]) == (None, True, 1)
        shown = [p for p in judge.calls if "Thanks, it runs." in p]
        assert shown and not any("[System:" in p for p in judge.calls)
    turns = {r["index"]: r for r in read_records(tmp_path) if r.get("kind") == "turn"}
    assert turns[0]["next_state"] == [{"role": "user", "content": TRUNCATED}]  # as it came
