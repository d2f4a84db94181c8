"""`--max-completion-tokens N`: an operator's cap on every request's completion budget (issue
41). Hermes Agent's custom provider always asks for `max_tokens: 65536`; clamped only to the
window, a first turn on a CPU was still generating after 17 minutes. Here a Hermes-shaped request
(its system prompt, 20 tool schemas, 65,536 asked for) goes through the real app on a real port
with the real openai and anthropic SDKs, in all three APIs: each reply is cut at N with its
API's `length`, its usage says N, and the turn record says which limit cut it."""

from __future__ import annotations

import anthropic
import pytest
import requests

from conftest import read_records, server_with
from rlproxy.appkeys import MODEL, SESSIONS

CAP = 24
capped = server_with(max_completion_tokens=CAP)
uncapped = server_with()

# Hermes Agent 0.19's shape: a long system prompt, ~20 tools, max_tokens 65536, streamed.
HERMES_TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"Hermes tool {name}: does {name.replace('_', ' ')}.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "a file or folder"},
        "content": {"type": "string"}}, "required": ["path"]}}}
    for name in ("terminal", "read_file", "write_file", "patch", "search_files", "web_search",
                 "web_extract", "browser_navigate", "browser_click", "browser_type",
                 "vision_analyze", "image_generate", "skills_list", "skill_view", "todo",
                 "memory", "session_search", "clarify", "execute_code", "delegate_task")]
HERMES_MESSAGES = [
    {"role": "system", "content": "You are Hermes Agent, an intelligent AI assistant created by "
     "Nous Research. You are helpful, knowledgeable, and direct. " * 20},
    {"role": "user", "content": "Write a Python script that prints the first 20 primes."}]


def no_eos(server) -> dict:
    """logit_bias that keeps the tiny model from ending before its budget."""
    return {str(t): -100 for t in server.app[MODEL].tokenizer.eos_token_ids}


def turns(server) -> list[dict]:
    server.app[SESSIONS].flushed().result(timeout=30)
    return [r for name in ("conversations.jsonl", "pending_turns.jsonl")
            for r in read_records(server.data_dir, name) if r.get("kind") == "turn"]


def test_a_hermes_shaped_request_is_capped_in_all_three_apis(capped):
    assert len(HERMES_TOOLS) == 20
    c = capped.client().with_options(timeout=60)  # uncapped: minutes of tokens, a timeout
    whole = c.chat.completions.create(
        model="hermes", messages=HERMES_MESSAGES, tools=HERMES_TOOLS, max_tokens=65536,
        logit_bias=no_eos(capped), extra_headers={"X-Session-Id": "hermes-whole"})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == CAP

    chunks = list(c.chat.completions.create(
        model="hermes", messages=HERMES_MESSAGES, tools=HERMES_TOOLS, max_tokens=65536,
        stream=True, stream_options={"include_usage": True}, logit_bias=no_eos(capped),
        extra_headers={"X-Session-Id": "hermes-chat"}))
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices
              and ch.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == CAP

    resp = c.responses.create(
        model="hermes", instructions=HERMES_MESSAGES[0]["content"],
        input=HERMES_MESSAGES[1]["content"], max_output_tokens=65536,
        tools=[{"type": "function", **t["function"]} for t in HERMES_TOOLS],
        extra_body={"logit_bias": no_eos(capped)})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == CAP

    msg = anthropic.Anthropic(base_url=capped.url, api_key="x", max_retries=0).messages.create(
        model="hermes", max_tokens=65536, system=HERMES_MESSAGES[0]["content"],
        messages=[HERMES_MESSAGES[1]], timeout=120,
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in HERMES_TOOLS],
        extra_body={"logit_bias": no_eos(capped)})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == CAP

    by_api = {}
    for r in turns(capped):
        by_api.setdefault(r["api"], []).append(r)
    assert sorted(by_api) == ["chat", "messages", "responses"]
    for r in (x for recs in by_api.values() for x in recs):
        s = r["sampling"]
        assert (s["max_tokens"], s["max_tokens_requested"], s["max_tokens_clamped"],
                s["max_tokens_clamped_by"]) == (CAP, 65536, True, "max_completion_tokens")
        assert len(r["choices"][0]["completion_ids"]) == CAP
        assert r["choices"][0]["finish_reason"] == "length"


def test_budgets_within_the_cap_are_untouched_and_a_missing_one_is_capped(capped):
    c = capped.client()
    small = c.chat.completions.create(model="m", messages=HERMES_MESSAGES[1:], max_tokens=5,
                                      logit_bias=no_eos(capped),
                                      extra_headers={"X-Session-Id": "small"})
    assert small.usage.completion_tokens == 5
    # none named: --default-max-tokens (1024) is over the cap too
    unnamed = c.chat.completions.create(model="m", messages=HERMES_MESSAGES[1:],
                                        logit_bias=no_eos(capped),
                                        extra_headers={"X-Session-Id": "unnamed"})
    assert unnamed.usage.completion_tokens == CAP
    got = {r["session_id"]: r["sampling"] for r in turns(capped)}
    assert got["small"]["max_tokens_clamped_by"] is None
    assert (got["unnamed"]["max_tokens"], got["unnamed"]["max_tokens_clamped"]) == (CAP, False)


def test_without_the_cap_only_the_window_clamps(uncapped):
    """Off by default: the card names no cap, and 65,536 asked of the 131,072-token window is
    granted (a short budget here keeps the test short: what counts is the recorded budget)."""
    card = requests.get(uncapped.base_url + "/models").json()["data"][0]
    assert "max_completion_tokens" not in card
    r = uncapped.client().chat.completions.create(
        model="m", messages=HERMES_MESSAGES[1:], max_tokens=3,
        extra_headers={"X-Session-Id": "free"})
    assert r.usage.completion_tokens <= 3
    (rec,) = [t for t in turns(uncapped) if t["session_id"] == "free"]
    assert rec["sampling"]["max_tokens"] == 3 and rec["sampling"]["max_tokens_clamped_by"] is None


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_cap_below_one_is_refused_at_start(value):
    from rlproxy.settings import load_settings

    with pytest.raises(ValueError, match="max_completion_tokens"):
        load_settings({"max_completion_tokens": int(value)}, environ={})


def test_logit_bias_reaches_the_sampler_in_responses_and_messages(capped):
    """Responses and Messages take Chat Completions' logit_bias (an extension, sent with the
    SDKs' extra_body): a +100 bias on one token makes every sampled token that one, the turn
    record keeps it, and a bad key is a 400 in each API's shape naming the field. (Before, both
    ignored it, and the test above saw an end token ~1 run in 75.)"""
    token = 65
    resp = capped.client().responses.create(
        model="m", input="hi", max_output_tokens=6, extra_body={"logit_bias": {str(token): 100}},
        extra_headers={"X-Session-Id": "bias-responses", "X-Session-Done": "1"})
    assert resp.usage.output_tokens == 6
    msg = anthropic.Anthropic(base_url=capped.url, api_key="x", max_retries=0).messages.create(
        model="m", max_tokens=6, messages=[{"role": "user", "content": "hi"}],
        extra_body={"logit_bias": {str(token): 100}},
        extra_headers={"X-Session-Id": "bias-messages", "X-Session-Done": "1"})
    assert msg.usage.output_tokens == 6
    got = {r["session_id"]: r for r in turns(capped)}
    for sid in ("bias-responses", "bias-messages"):
        assert got[sid]["choices"][0]["completion_ids"] == [token] * 6, sid
    r = requests.post(capped.url + "/v1/responses", timeout=30,
                      json={"model": "m", "input": "hi", "logit_bias": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = requests.post(capped.url + "/v1/messages", timeout=30,
                      headers={"anthropic-version": "2023-06-01"},
                      json={"model": "m", "max_tokens": 4, "logit_bias": {"1": 500},
                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "logit_bias" in r.json()["error"]["message"], r.text
