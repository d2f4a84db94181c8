"""POST /v1/messages and /v1/messages/count_tokens, through the real anthropic SDK and the real
server: content blocks, the SSE event sequence, tool_use -> tool_result round trips filed as one
session, and bad input answered in Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json
import re
import time

import anthropic
import pytest
import requests
from anthropic.lib.streaming._messages import accumulate_event

from rlproxy.api.messages_output import Blocks, body_as_events, with_pings

from conftest import (HELLO_PROMPT, HELLO_REPLY, TOOL_PROMPT, TOOLS, ServerThread, make_settings,
                      read_records)

# conftest's get_weather tool, as Anthropic declares it
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}  # this SDK release has no temperature argument: sent as extra_body
MSG = [{"role": "user", "content": "Hi there"}]


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "x"),
                               max_retries=0, timeout=120, **kw)


def test_create_returns_a_message(server):
    r = client(server).messages.create(model="m", max_tokens=12, system="Be brief.", messages=MSG,
                                       extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == "m"
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert [b.type for b in r.content] in (["text"], [])
    assert 0 < r.usage.output_tokens <= 12
    count = client(server).messages.count_tokens(model="m", system="Be brief.", messages=MSG)
    # The whole prompt is input_tokens plus what the prefix cache held.
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == count.input_tokens
    assert r.usage.cache_creation_input_tokens == 0


def test_max_tokens_is_respected(server):
    r = client(server).messages.create(model="m", max_tokens=3, messages=MSG,
                                       extra_body={"temperature": 1, "top_p": 0.9})
    assert r.usage.output_tokens <= 3
    if r.usage.output_tokens == 3:
        assert r.stop_reason == "max_tokens"


def test_top_k_one_samples_the_greedy_tokens(server):
    c = client(server)
    greedy = c.messages.create(model="m", max_tokens=8, messages=MSG, extra_body=GREEDY)
    top1 = c.messages.create(model="m", max_tokens=8, messages=MSG,
                             extra_body={"temperature": 1, "top_k": 1})
    assert top1.content == greedy.content
    assert top1.usage.output_tokens == greedy.usage.output_tokens


def test_stream_helper_matches_non_streaming(server):
    c = client(server)
    kw = dict(model="m", max_tokens=16, system=[{"type": "text", "text": "Be brief."}],
              messages=MSG, extra_body=GREEDY)
    with c.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = c.messages.create(**kw)
    assert text == "".join(b.text for b in plain.content)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_event_sequence(server):
    events = list(client(server).messages.create(model="m", max_tokens=8, messages=MSG,
                                                 stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.stop_reason is None and events[0].message.content == []
    body = kinds[1:-2]
    if body:  # one text block: start, deltas, stop
        assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
        assert set(body[1:-1]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens <= 8


def test_ping_follows_message_start(server):
    with requests.post(f"{server.url}/v1/messages", stream=True, timeout=60, json={
            "model": "m", "max_tokens": 2, "messages": MSG, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: "):] for line in r.iter_lines(decode_unicode=True)
                 if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_stop_sequence_is_reported(taught_server):
    r = client(taught_server).messages.create(
        model="m", max_tokens=60, messages=HELLO_PROMPT, stop_sequences=["city", "Paris"],
        extra_body=GREEDY)
    assert r.content[0].text == "Hello from "
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    r = client(taught_server).messages.create(model="m", max_tokens=60, messages=HELLO_PROMPT,
                                              extra_body=GREEDY)
    assert r.content[0].text == HELLO_REPLY and r.stop_reason == "end_turn"


def session_turns(server, sid: str, n: int = 1) -> list[dict]:
    """End the session; its turn records once at least `n` are on disk (the last one reaches
    its file on the records writer thread, just after the end call answers)."""
    requests.post(f"{server.url}/v1/sessions/{sid}/end", timeout=30).raise_for_status()
    deadline = time.time() + 15
    while True:
        turns = sorted((t for t in read_records(server.settings.records.data_dir)
                        if t["session_id"] == sid), key=lambda t: t["index"])
        if len(turns) >= n or time.time() > deadline:
            return turns
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip_links_the_next_state(taught_server, stream):
    c = client(taught_server)
    messages = [{"role": "user", "content": TOOL_PROMPT[0]["content"]}]
    kw = dict(model="m", max_tokens=60, tools=A_TOOLS, extra_body=GREEDY)
    if stream:
        with c.messages.stream(messages=messages, **kw) as s:
            first = s.get_final_message()
        sid = s.response.headers["x-session-id"]
    else:
        raw = c.messages.with_raw_response.create(messages=messages, **kw)
        first, sid = raw.parse(), raw.headers["x-session-id"]
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input == {"city": "Paris"}

    result = [{"type": "tool_result", "tool_use_id": call.id,
               "content": [{"type": "text", "text": "18 C and sunny"}]}]
    messages += [first.to_param(), {"role": "user", "content": result}]
    raw = c.messages.with_raw_response.create(messages=messages, **kw)
    assert raw.headers["x-session-id"] == sid  # matched by prefix: no session header sent
    raw.parse()

    turns = session_turns(taught_server, sid, 2)
    assert [t["api"] for t in turns] == ["messages", "messages"]
    assert turns[0]["choices"][0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [(m["role"], m["content"]) for m in turns[0]["next_state"]] == \
        [("tool", "18 C and sunny")]
    assert turns[1]["messages"][-1]["tool_call_id"] == call.id


def test_streamed_tool_use_events(taught_server):
    events = list(client(taught_server).messages.create(
        model="m", max_tokens=60, messages=[{"role": "user", "content": TOOL_PROMPT[0]["content"]}],
        tools=A_TOOLS, stream=True, extra_body=GREEDY))
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0].partial_json) == {"city": "Paris"}
    assert events[-2].delta.stop_reason == "tool_use"


def test_disable_parallel_tool_use_streams_one_call(taught_server):
    # (the one-call filter itself: test_responses.test_first_tool_call_only_...)
    events = list(client(taught_server).messages.create(
        model="m", max_tokens=60, messages=[{"role": "user", "content": TOOL_PROMPT[0]["content"]}],
        tools=A_TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stream=True, extra_body=GREEDY))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts if b.type == "tool_use"] == ["tool_use"]
    assert events[-2].delta.stop_reason == "tool_use"


def test_tool_error_result_and_tool_choice(taught_server):
    c = client(taught_server)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "let me look", "signature": "sig"},
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
                    "is_error": True},
                   {"type": "text", "text": "Try again."}]}]
    raw = c.messages.with_raw_response.create(
        model="m", max_tokens=5, messages=history, tools=A_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        metadata={"user_id": "user-7"}, thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"top_k": 5})
    raw.parse()
    (turn,) = session_turns(taught_server, raw.headers["x-session-id"])
    assert [(m["role"], m["content"]) for m in turn["messages"]] == [
        ("user", "Weather?"), ("assistant", "Checking."), ("tool", "Error: timeout"),
        ("user", "Try again.")]


def test_claude_code_session_header_and_system_messages(server):
    sid = "4e362fd9-e634-4d04-8ffd-af49e6194874"  # Claude Code's session id: a UUID
    c = client(server, default_headers={"X-Claude-Code-Session-Id": sid})
    raw = c.messages.with_raw_response.create(
        model="m", max_tokens=3, system=[{"type": "text", "text": "You are terse."},
                                         {"type": "text", "text": "Use tools."}],
        messages=[{"role": "user", "content": "hi"},
                  {"role": "system", "content": "Agent types: claude."}])  # mid-conversation
    assert raw.headers["x-session-id"] == sid
    (turn,) = session_turns(server, sid)
    assert [(m["role"], m["content"]) for m in turn["messages"]] == [
        ("system", "You are terse.\n\nUse tools."), ("user", "hi"),
        ("system", "Agent types: claude.")]


def test_count_tokens_counts_tools(server):
    c = client(server)
    bare = c.messages.count_tokens(model="m", messages=MSG).input_tokens
    with_tools = c.messages.count_tokens(model="m", messages=MSG, tools=A_TOOLS).input_tokens
    assert 0 < bare < with_tools


def test_models_list_parses_in_both_sdks(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [m.id for m in server.client().models.list().data]
    (info,) = models.data
    assert info.type == "model" and info.display_name == info.id and info.created_at.year > 2000
    assert client(server).models.retrieve(info.id).id == info.id


BAD = [
    ("image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]},
     "text only"),
    ("unknown block", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "hologram"),
    ("unknown tool_result id", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    ("missing max_tokens", {"max_tokens": None, "messages": MSG}, "max_tokens"),
    ("empty messages", {"messages": []}, "messages"),
    ("empty content", {"messages": [{"role": "user", "content": []}]}, "content"),
    ("prefill", {"messages": MSG + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ("temperature above 1", {"messages": MSG, "temperature": 1.5}, "temperature"),
    ("five stop sequences", {"messages": MSG, "stop_sequences": list("abcde")}, "stop_sequences"),
    ("not json", None, "JSON"),
    ("list block type", {"messages": [{"role": "user", "content": [{"type": ["text"]}]}]},
     "messages[0].content[0].type"),
    ("dict block type", {"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
     "messages[0].content[0].type"),
    # the translated chat request's fields, named as this request names them
    ("tool name with a space", {"messages": MSG, "tools": [{"name": "a b", "input_schema": {}}]},
     "tools[0].name:"),
    ("text block without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text: Field required"),
    ("session_done a number", {"messages": MSG, "session_done": 5}, "session_done: Input"),
]


@pytest.mark.parametrize("name,patch,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_anthropic_error(server, name, patch, needle):
    body = {"model": "m", "max_tokens": 5, "messages": MSG, **(patch or {})}
    body = {k: v for k, v in body.items() if v is not None}
    r = requests.post(f"{server.url}/v1/messages", timeout=30,
                      data=b"{nope" if patch is None else json.dumps(body),
                      headers={"content-type": "application/json", "anthropic-version": "2023-06-01",
                               "anthropic-beta": "future-feature-2099"})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


def test_sdk_raises_typed_errors(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client(server).post("/v1/messages/nothing-here", cast_to=dict, body={})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert e.value.body["error"]["message"].startswith("no route for POST /v1/messages/nothing")


# Sent by the real anthropic SDK (this release takes the sampling options as extra_body): a
# number out of range says its bound, in Anthropic's error shape
OUT_OF_RANGE = [({"max_tokens": 2**70}, f"max_tokens: must be at most {2**64 - 1}"),
                ({"max_tokens": -2**70}, "max_tokens: must be at least 1"),
                ({"extra_body": {"top_k": 2**70}}, f"top_k: must be at most {2**64 - 1}"),
                ({"extra_body": {"top_k": -1}}, "top_k: must be at least 0"),
                ({"extra_body": {"temperature": 5}}, "temperature: must be at most 1"),
                ({"extra_body": {"top_p": 0}}, "top_p: must be greater than 0")]


@pytest.mark.parametrize("kw,message", OUT_OF_RANGE,
                         ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(OUT_OF_RANGE)])
def test_a_number_out_of_range_says_its_bound(server, kw, message):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(**{"model": "m", "max_tokens": 5, "messages": MSG, **kw})
    assert e.value.status_code == 400
    assert e.value.response.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": message}}


@pytest.fixture(scope="module")
def strict_server(tiny, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("data"), api_key="sekrit",
                             strict_max_tokens=True, hosted_tools="reject")
    with ServerThread(settings, tiny) as s:
        yield s


def test_server_tools_are_a_400_under_reject(strict_server):
    """--hosted-tools reject (the default, drop, is in test_hosted_tools.py)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        client(strict_server, api_key="sekrit").messages.create(
            model="m", max_tokens=5, messages=MSG,
            tools=[{"type": "web_search_20250305", "name": "web_search"}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and "web_search" in err["message"]
    assert "--hosted-tools drop" in err["message"]


def test_api_key_via_x_api_key_or_bearer(strict_server):
    s = strict_server
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(s, api_key="wrong").messages.create(model="m", max_tokens=2, messages=MSG)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert client(s, api_key="sekrit").messages.create(
        model="m", max_tokens=2, messages=MSG).type == "message"
    bearer = anthropic.Anthropic(base_url=s.url, auth_token="sekrit", max_retries=0)
    assert bearer.messages.count_tokens(model="m", messages=MSG).input_tokens > 0
    assert s.client(api_key="sekrit").models.list().data  # the openai SDK: Bearer


# The patterns Claude Code 2.1 matches in an error to compact its history or shrink max_tokens.
TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
OVER_BUDGET = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > "
                         r"(\d+)")


def test_context_overflow_in_claude_codes_words(strict_server, tiny):
    c = client(strict_server, api_key="sekrit")
    context = tiny.context_length
    long = [{"role": "user", "content": " ".join(str(i) for i in range(context))}]
    size = c.messages.count_tokens(model="m", messages=long).input_tokens
    assert size > context
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=5, messages=long)
    assert TOO_LONG.search(e.value.message).groups() == (str(size), str(context))
    prompt = c.messages.count_tokens(model="m", messages=MSG).input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:  # --strict-max-tokens: no clamp
        c.messages.create(model="m", max_tokens=context, messages=MSG)
    assert OVER_BUDGET.search(e.value.message).groups() == (
        str(prompt), str(context), str(context))


# ---- the pure parts: blocks, events, pings ----

CALL = {"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
DELTAS = [("reasoning", "Hmm, "), ("reasoning", "weather."), ("content", "Let me "),
          ("content", "check."), ("tool_call", CALL), ("unknown-kind", 1), ("content", "Done")]


def test_blocks_stream_rebuilds_the_body_in_the_sdk():
    blocks, events = Blocks(), [
        {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0}}}]
    for kind, value in DELTAS:
        events += [data for _, data in blocks.add(kind, value)]
    events += [data for _, data in blocks.close()]
    assert blocks.content == [
        {"type": "thinking", "thinking": "Hmm, weather.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "text", "text": "Done"}]
    snapshot, bufs = None, {}
    for e in events:  # the anthropic SDK's own stream accumulator
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.to_dict() for b in snapshot.content] == blocks.content
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3]


def test_kept_body_replays_as_the_same_events():
    blocks = Blocks()
    for kind, value in DELTAS:
        blocks.add(kind, value)
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": blocks.content, "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 2, "output_tokens": 9, "cache_read_input_tokens": 1,
                      "cache_creation_input_tokens": 0}}
    snapshot, bufs = None, {}
    for payload in body_as_events(body):
        data = json.loads(payload.decode().split("data: ", 1)[1])
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot.to_dict(exclude_none=True) == {k: v for k, v in body.items() if v is not None}


async def test_with_pings_fills_silences_and_loses_nothing():
    async def slow():
        for i in range(3):
            await asyncio.sleep(0.05 if i != 1 else 0.35)
            yield i

    got = [x async for x in with_pings(slow(), 0.1)]
    assert [x for x in got if x is not None] == [0, 1, 2]
    assert got.index(1) > got.index(0) + 1  # pings came while item 1 was slow
