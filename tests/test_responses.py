"""POST/GET/DELETE /v1/responses over real HTTP: the real openai and openai-agents SDKs against
the real server and the embedded tiny model (the taught adapter where a test needs tool calls)."""

from __future__ import annotations

import json
import time

import agents
import openai
import pytest
import requests
from agents import (
    Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
)


from conftest import HELLO_REPLY, TOOLS, ServerThread, make_settings, read_records

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # Responses tools are flat
WEATHER = "What is the weather in Paris?"


def turns_of(server, session_id: str, n: int = 1) -> list[dict]:
    """The session's turn records, once at least `n` are on disk (a closing session's last
    turn reaches its file on the records writer thread, just after the answer)."""
    deadline = time.time() + 15
    while True:
        records = read_records(server.settings.records.data_dir)
        turns = sorted((r for r in records if r["session_id"] == session_id),
                       key=lambda r: r["index"])
        if len(turns) >= n or time.time() > deadline:
            return turns
        time.sleep(0.05)


def test_non_streaming_response_shape_and_record(server):
    raw = server.client().responses.with_raw_response.create(
        model="any-name", instructions="You are terse.", input="Hi there", max_output_tokens=6,
        metadata={"k": "v"}, reasoning={"effort": "high"}, text={"format": {"type": "text"}},
        extra_headers={"X-Session-Done": "1"})
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "any-name"
    assert r.metadata == {"k": "v"} and r.instructions == "You are terse."
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    [part] = msg.content
    assert part.type == "output_text" and part.annotations == [] and r.output_text == part.text
    u = r.usage
    assert u.output_tokens <= 6 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0
    assert u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 6
    else:
        # an end token sampled as the 6th: completed at the budget (sampled at temperature 1)
        assert r.status == "completed" and u.output_tokens <= 6
    [turn] = turns_of(server, raw.headers["X-Session-Id"])
    assert turn["api"] == "responses" and turn["uid"] == raw.headers["X-Turn-Uid"]
    assert turn["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "Hi there"}]
    assert turn["choices"][0]["text"] == r.output_text
    assert len(turn["choices"][0]["completion_ids"]) == u.output_tokens
    assert turn["end"] == "session_done"


def test_streaming_event_sequence(server):
    c = server.client()
    events = list(c.responses.create(model="m", input="Hi there", max_output_tokens=12,
                                     temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{events[-1].response.status}"]
    assert events[-1].response.status in ("completed", "incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert deltas and "".join(d.delta for d in deltas) == final.output_text
    item_id = final.output[0].id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0
               for d in deltas)
    # same text as the non-streamed response (temperature 0), and stored for GET
    again = c.responses.create(model="m", input="Hi there", max_output_tokens=12, temperature=0)
    assert again.output_text == final.output_text
    assert c.responses.retrieve(final.id).output[0].content[0].text == final.output_text


def test_sdk_stream_helper_gives_the_final_response(taught_server):
    # (the helper wants response.completed: the taught reply ends before any token limit)
    with taught_server.client().responses.stream(model="m", input="Say hello.",
                                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text == HELLO_REPLY and final.status == "completed"


def test_function_call_round_trip_with_previous_response_id(taught_server):
    c = taught_server.client()
    first = c.responses.with_raw_response.create(model="m", input=WEATHER, tools=FLAT_TOOLS,
                                                 temperature=0)
    r = first.parse()
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed" and r.status == "completed"
    # The follow-up sends only the new item; the chain is the session, and its thread.
    second = c.responses.with_raw_response.create(
        model="m", previous_response_id=r.id, tools=FLAT_TOOLS, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        extra_headers={"X-Session-Done": "1"})
    r2 = second.parse()
    assert r2.status == "completed" and r2.previous_response_id == r.id
    sid = first.headers["X-Session-Id"]
    assert second.headers["X-Session-Id"] == sid
    t1, t2 = turns_of(taught_server, sid, 2)
    assert (t1["api"], t2["api"]) == ("responses", "responses")
    assert t1["next_state"] == [{"role": "tool", "tool_call_id": call.call_id,
                                 "content": "sunny"}]
    assert t1["next_state_link"] == "prefix" and t1["thread"] == t2["thread"]
    assert t2["messages"][-2]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_full_input_resent_without_chain_links_by_prefix(taught_server):
    """Codex's way: store false, and every request resends the whole conversation."""
    c = taught_server.client()
    first = c.responses.with_raw_response.create(model="m", input=WEATHER, tools=FLAT_TOOLS,
                                                 temperature=0, store=False)
    r = first.parse()
    call = r.output[0]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)  # not stored
    history = [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": WEATHER}]},
               call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = c.responses.with_raw_response.create(model="m", input=history, tools=FLAT_TOOLS,
                                                  temperature=0, store=False)
    sid = first.headers["X-Session-Id"]
    assert second.headers["X-Session-Id"] == sid  # no session header: found by prefix
    requests.post(f"{taught_server.base_url}/sessions/{sid}/end", timeout=30).raise_for_status()
    t1, _ = turns_of(taught_server, sid, 2)
    assert t1["next_state_link"] == "prefix"
    assert t1["next_state"] == [{"role": "tool", "tool_call_id": call.call_id,
                                 "content": "sunny"}]


def test_function_call_streams_as_documented(taught_server):
    events = list(taught_server.client().responses.create(
        model="m", input=WEATHER, tools=FLAT_TOOLS, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.status == "in_progress" and added.output_index == 0
    assert json.loads(done.arguments) == {"city": "Paris"} and delta.delta == done.arguments
    assert delta.item_id == done.item_id == item_done.item.id == added.item.id
    assert events[-1].response.output[0].call_id == item_done.item.call_id


def test_namespace_tools_are_offered_flat_and_calls_name_their_namespace(taught_server):
    # Codex sends its sub-agent tools as {"type": "namespace", "tools": [...]}
    ns = [{"type": "namespace", "name": "weather", "description": "Weather tools",
           "tools": FLAT_TOOLS}]
    r = taught_server.client().responses.create(model="m", input=WEATHER, tools=ns,
                                                temperature=0)
    [call] = r.output
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "weather")


def test_get_and_delete(server):
    c = server.client()
    r = c.responses.create(model="m", input="Hi", max_output_tokens=3)
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    c.responses.delete(r.id)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="Hi", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"


def test_stored_responses_survive_a_restart(tiny, tmp_path):
    settings = make_settings(tmp_path)
    with ServerThread(settings, tiny) as s:
        r = s.client().responses.create(model="m", input="Hi", max_output_tokens=3)
    with ServerThread(settings, tiny) as s:
        c = s.client()
        assert c.responses.retrieve(r.id).output_text == r.output_text
        follow = c.responses.create(model="m", input="More", previous_response_id=r.id,
                                    max_output_tokens=3)
        assert follow.usage.input_tokens > r.usage.input_tokens


def test_idempotent_retry_replays(server):
    c = server.client()
    kw = dict(model="m", input="Hi", max_output_tokens=4, extra_headers={"X-Request-Id": "rq-1"})
    a = c.responses.create(**kw)
    b = c.responses.with_raw_response.create(**kw)
    assert b.headers["X-Idempotent-Replay"] == "true" and b.parse().id == a.id
    streamed = list(c.responses.create(stream=True, **kw))  # a stream retry of a full response
    assert streamed[-1].response.id == a.id


BAD = [
    ("empty string", {"input": ""}, "input"),
    ("empty list", {"input": []}, "input"),
    ("unknown item", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ("json schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                        "schema": {}}}}, "text.format"),
    ("image part", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ("unknown call id", {"input": [{"type": "function_call_output", "call_id": "nope",
                                    "output": "x"}]}, "input[0].call_id"),
    ("bad arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                  "arguments": "[1]"}]}, "input[0].arguments"),
    ("tool role", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ("hosted tool choice", {"input": "hi", "tools": FLAT_TOOLS,
                            "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ("unknown tool choice", {"input": "hi", "tools": FLAT_TOOLS,
                             "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ("input of numbers", {"input": [1]}, "input"),
    ("unknown tool choice string", {"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ("string temperature", {"input": "hi", "temperature": "1"}, "temperature"),
    ("no input", {}, "input"),
    # user data that once reached a set/dict lookup (or a key after generation): 500s then
    ("namespace without a name", {"input": "hi", "tools": [
        {"type": "namespace", "tools": [{"type": "function", "name": "f"}]}]}, "tools[0].name"),
    ("list part type", {"input": [{"role": "user", "content": [{"type": ["x"]}]}]},
     "input[0].content[0]"),
    ("dict part type", {"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
     "input[0].content[0]"),
    ("list call id", {"input": [{"type": "function_call_output", "call_id": ["c"],
                                 "output": "x"}]}, "input[0].call_id"),
    ("dict call id", {"input": [{"type": "function_call_output", "call_id": {"c": 1},
                                 "output": "x"}]}, "input[0].call_id"),
    ("list item type", {"input": [{"type": ["message"], "role": "user", "content": "x"}]},
     "input[0].type"),
    # params name this request's fields, never the translated chat request's or pydantic's
    ("tool name with a space", {"input": "hi", "tools": [{"type": "function", "name": "a b"}]},
     "tools[0].name"),
    ("tool name a list", {"input": "hi", "tools": [{"type": "function", "name": ["f"]}]},
     "tools[0].name"),
    ("tool without a name", {"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ("namespaced tool name", {"input": "hi", "tools": [{"type": "namespace", "name": "n",
                                                        "tools": [{"type": "function",
                                                                   "name": 5}]}]},
     "tools[0].tools[0].name"),
    ("tool parameters a list", {"input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": [1]}]}, "tools[0].parameters"),
    ("tool_choice a number", {"input": "hi", "tool_choice": 5}, "tool_choice"),
    ("session_done a number", {"input": "hi", "session_done": 5}, "session_done"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_in_openai_shape(server, body, param):
    r = requests.post(server.base_url + "/responses", json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


# Sent by the real openai SDK: a number out of range says its bound, in OpenAI's error shape
OUT_OF_RANGE = [({"max_output_tokens": 2**70}, "max_output_tokens",
                 f"must be at most {2**64 - 1}", "integer_above_max_value"),
                ({"max_output_tokens": -2**70}, "max_output_tokens", "must be at least 1",
                 "integer_below_min_value"),
                ({"temperature": 5}, "temperature", "must be at most 2",
                 "decimal_above_max_value"),
                ({"top_p": 0}, "top_p", "must be greater than 0", "decimal_below_min_value")]


@pytest.mark.parametrize("kw,param,said,code", OUT_OF_RANGE,
                         ids=[f"{p}-{i}" for i, (_, p, _s, _c) in enumerate(OUT_OF_RANGE)])
def test_a_number_out_of_range_says_its_bound(server, kw, param, said, code):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model="m", input="Hi", **kw)
    assert e.value.status_code == 400
    assert e.value.response.json() == {"error": {
        "message": f"{param}: {said}", "type": "invalid_request_error", "param": param,
        "code": code}}


# --hosted-tools reject (the default, drop, is in test_hosted_tools.py)
HOSTED = [
    ("hosted tool", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("hosted tool in a namespace", {"input": "hi", "tools": [
        {"type": "namespace", "name": "n", "tools": [{"type": "file_search"}]}]},
     "tools[0].tools[0].type"),
]


@pytest.fixture(scope="module")
def reject_server(tiny, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("data"), hosted_tools="reject")
    with ServerThread(settings, tiny) as s:
        yield s


@pytest.mark.parametrize("body,param", [b[1:] for b in HOSTED], ids=[b[0] for b in HOSTED])
def test_hosted_tools_are_a_400_under_reject(reject_server, body, param):
    r = requests.post(reject_server.base_url + "/responses", json={"model": "m", **body},
                      timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_tool_type"
    assert "--hosted-tools drop" in err["message"]


def test_bad_json_body(server):
    r = requests.post(server.base_url + "/responses", data=b"{nope", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.fixture
def weather_tool():
    calls: list[dict] = []

    async def on_invoke(ctx, args: str) -> str:
        calls.append(json.loads(args))
        return "sunny"

    # The taught adapter answers this exact tool (strict is not shown to the model).
    tool = FunctionTool(name="get_weather", description=TOOLS[0]["function"]["description"],
                        params_json_schema=TOOLS[0]["function"]["parameters"],
                        on_invoke_tool=on_invoke, strict_json_schema=False)
    return tool, calls


@pytest.mark.parametrize("model_cls,api", [(OpenAIResponsesModel, "responses"),
                                           (OpenAIChatCompletionsModel, "chat")])
async def test_openai_agents_runs_a_function_tool(taught_server, weather_tool, model_cls, api):
    agents.set_tracing_disabled(True)
    tool, calls = weather_tool
    model = model_cls(model="m", openai_client=taught_server.async_client())
    agent = Agent(name="weather", tools=[tool], model=model,
                  model_settings=ModelSettings(temperature=0))
    result = await Runner.run(agent, WEATHER, max_turns=3)
    assert calls == [{"city": "Paris"}]  # the model called the tool, the agent ran it
    streamed = Runner.run_streamed(agent, WEATHER, max_turns=3)
    async for _ in streamed.stream_events():
        pass
    assert calls == [{"city": "Paris"}] * 2 and streamed.final_output == result.final_output
    assert isinstance(result.final_output, str)
    records = read_records(taught_server.settings.records.data_dir)
    linked = [r for r in records if r["api"] == api and r["next_state"]
              and r["next_state"][0].get("content") == "sunny"]
    assert linked and linked[-1]["next_state_link"] == "prefix"


def test_reasoning_becomes_a_reasoning_item(thinking_model, tmp_path):
    with ServerThread(make_settings(tmp_path), thinking_model) as s:
        c = s.client()
        kw = dict(model="m", input="think", max_output_tokens=8, temperature=0)
        full = c.responses.create(**kw)
        events = list(c.responses.create(stream=True, **kw))
    rs, msg = full.output
    assert rs.type == "reasoning" and rs.id.startswith("rs_") and rs.summary == []
    assert rs.content[0].type == "reasoning_text" and rs.content[0].text
    assert msg.type == "message" and full.output_text == ""  # nothing after the think block
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == rs.content[0].text  # temperature 0: the same text streamed
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == rs.content[0].text and done.output_index == 0
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_chain_into_a_closed_session_continues_its_numbering(server):
    c = server.client()
    for headers in ({"X-Session-Id": "closed-chain"}, {}):  # explicit, then inferred (auto-...)
        first = c.responses.with_raw_response.create(
            model="m", input="Hi there", max_output_tokens=3,
            extra_headers={**headers, "X-Session-Done": "1"})
        sid = first.headers["X-Session-Id"]
        second = c.responses.with_raw_response.create(
            model="m", input="More", max_output_tokens=3, previous_response_id=first.parse().id)
        assert second.headers["X-Session-Id"] == sid
        requests.post(f"{server.base_url}/sessions/{sid}/end", timeout=30).raise_for_status()
        assert [t["index"] for t in turns_of(server, sid, 2)] == [0, 1]
        session = requests.get(f"{server.base_url}/sessions/{sid}", timeout=30).json()
        assert session["inferred"] is (not headers)


def items(output) -> list[tuple]:
    return [(o.type, o.status, getattr(o, "content", None) and o.content[0].text)
            for o in output]


def test_stream_and_full_response_agree_at_the_token_limit(server):
    c = server.client()
    kw = {"model": "m", "input": "Tell me a long story", "max_output_tokens": 4,
          "temperature": 0}
    full = c.responses.create(**kw)
    streamed = list(c.responses.create(stream=True, **kw))[-1].response
    assert full.status == streamed.status == "incomplete"
    assert items(full.output) == items(streamed.output)
    assert full.output[-1].status == "incomplete"


def test_parallel_tool_calls_false_keeps_the_first_call(taught_server):
    c = taught_server.client()
    r = c.responses.create(model="m", input=WEATHER, tools=FLAT_TOOLS, temperature=0,
                           parallel_tool_calls=False)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and r.parallel_tool_calls is False


def test_first_tool_call_only_trims_events_and_the_finished_record():
    # The tiny models never emit two calls in one answer: this drives the filter itself.
    from rlproxy.api.turns import first_tool_call_only
    from rlproxy.serving.completions import ChoiceEvent, ChoiceRecord
    a, b, d = ({"id": f"call_{x}", "type": "function",
                "function": {"name": x, "arguments": "{}"}} for x in "abd")
    parsed, rec = [a], ChoiceRecord(index=0, seed=0)
    ev = ChoiceEvent(0, [("content", "x"), ("tool_call", a)], [], None)
    first_tool_call_only(ev, parsed, rec)
    assert ev.deltas == [("content", "x"), ("tool_call", a)]
    parsed += [b, d]
    ev = ChoiceEvent(0, [("tool_call", b), ("content", "y"), ("tool_call", d)], [], "tool_calls")
    rec.finish_reason, rec.tool_calls, rec.completion_ids = "tool_calls", parsed, [1, 2, 3]
    first_tool_call_only(ev, parsed, rec)
    assert ev.deltas == [("content", "y")] and rec.tool_calls == [a]
    assert rec.completion_ids == [1, 2, 3] and len(parsed) == 3
