"""Unit tests for rlproxy.protocol: request parsing, error shape, builders."""

import copy
import json

import orjson
import pytest

from rlproxy.api.responses_input import ResponsesRequest
from rlproxy.api.tags import parse_turn_tags
from rlproxy.protocol import (
    APIError, ChatRequest, chat_completion, choice, chunk, completion_id, delta_choice,
    json_depth, load_json, parse_chat_request, shown, template_messages, template_tools,
    token_logprob, tool_call_id, usage, validate)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def full_body() -> dict:
    return {
        "model": "qwen",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                         {"type": "text", "text": "Paris?"}], "name": "ann"},
            {"role": "assistant", "content": None, "reasoning_content": "thinking...",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": "END",
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"42": -100, "7": 2.5},
        "response_format": {"type": "text"},
        "user": "u1",
    }


def parse(body: dict) -> ChatRequest:
    return parse_chat_request(orjson.dumps(body))


def minimal(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_full_request_parses_and_normalizes():
    req = parse(full_body())
    assert req.model == "qwen"
    assert req.stop == ["END"]
    assert req.max_tokens == 20 and req.max_completion_tokens == 20
    assert req.messages[1].content == "Weather in Paris?"
    assert req.temperature == 0.7 and req.top_p == 0.9 and req.n == 2 and req.seed == 7
    assert req.stream is True and req.stream_options.include_usage is True
    assert req.logprobs is True and req.top_logprobs == 3
    assert req.logit_bias == {42: -100.0, 7: 2.5}
    assert req.tool_choice == "auto" and req.parallel_tool_calls is True


def test_defaults():
    req = parse(minimal())
    assert (req.temperature, req.top_p, req.n, req.stream, req.stop, req.max_tokens) == (1.0, 1.0, 1, False, None, None)
    assert (req.logprobs, req.top_logprobs, req.presence_penalty, req.frequency_penalty) == (False, None, 0.0, 0.0)
    assert req.tools is None and req.tool_choice is None and req.response_format is None


def test_max_tokens_alone_is_kept():
    assert parse(minimal(max_tokens=5)).max_tokens == 5


def test_nulls_mean_default():
    req = parse(minimal(temperature=None, tools=None, stop=None, stream_options=None, top_logprobs=None))
    assert req.temperature == 1.0 and req.tools is None and req.stop is None


def test_template_messages():
    assert template_messages(parse(full_body())) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


def test_template_tools():
    assert template_tools(parse(full_body())) == [WEATHER_TOOL]
    assert template_tools(parse(minimal())) is None
    assert template_tools(parse(minimal(tools=[WEATHER_TOOL], tool_choice="none"))) is None


def test_named_tool_choice_accepted():
    choice_ = {"type": "function", "function": {"name": "get_weather"}}
    req = parse(minimal(tools=[WEATHER_TOOL], tool_choice=choice_))
    assert req.tool_choice.function.name == "get_weather"


def test_unknown_fields_ignored():
    body = minimal(vendor_knob=3, reasoning_effort="high")
    body["messages"][0]["cache_control"] = {"type": "ephemeral"}
    req = parse(body)
    assert req.messages[0].content == "hi"
    assert "vendor_knob" not in req.model_dump()


def test_session_fallbacks_kept_but_not_templated():
    req = parse(minimal(session_id="s1", turn_type="policy", session_done=True))
    assert (req.session_id, req.turn_type, req.session_done) == ("s1", "policy", True)
    assert template_messages(req) == [{"role": "user", "content": "hi"}]
    assert parse(minimal(session_done="true")).session_done == "true"


def _msg(**m):
    return minimal(messages=[m])


BAD = [
    # (body, param, message fragment)
    ({"messages": [{"role": "user", "content": "x"}]}, "model", "Field required"),
    (minimal(model=""), "model", "at least 1"),
    ({"model": "m"}, "messages", "Field required"),
    (minimal(messages=[]), "messages", "at least 1"),
    (_msg(role="robot", content="x"), "messages[0].role", "Input should be"),
    (_msg(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]),
     "messages[0].content", "this model accepts text only"),
    (_msg(role="user", content=[{"type": "input_audio"}]), "messages[0].content", "text only"),
    (_msg(role="user", content=[{"type": "text"}]), "messages[0].content", "string 'text'"),
    (_msg(role="user", content=None), "messages[0].content", "needs content"),
    (_msg(role="system"), "messages[0].content", "needs content"),
    (_msg(role="assistant"), "messages[0].content", "content or tool_calls"),
    (_msg(role="tool", content="x"), "messages[0].tool_call_id", "tool_call_id"),
    (_msg(role="tool", tool_call_id="c"), "messages[0].content", "needs content"),
    (_msg(role="assistant", tool_calls=[{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "[1]"}}]),
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    (_msg(role="assistant", tool_calls=[{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "{oops"}}]),
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    (_msg(role="assistant", tool_calls=[{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": {"a": 1}}}]),
     "messages[0].tool_calls[0].function.arguments", "valid string"),
    (minimal(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
     "tools[0].function.name", "1-64 characters"),
    (minimal(tools=[{"type": "function", "function": {"name": "x" * 65}}]),
     "tools[0].function.name", "1-64 characters"),
    (minimal(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", "Input should be"),
    (minimal(tool_choice="required"), "tool_choice", "no tools"),
    (minimal(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "no tools"),
    (minimal(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "'nope' is not among"),
    (minimal(tools=[WEATHER_TOOL], tool_choice="sometimes"), "tool_choice", '"required"'),
    (minimal(temperature="1"), "temperature", "valid number"),
    (minimal(stream="yes"), "stream", "valid boolean"),
    (minimal(stream_options={"include_usage": True}), "stream_options", "'stream' is true"),
    (minimal(stream=False, stream_options={"include_usage": True}), "stream_options", "'stream' is true"),
    (minimal(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (minimal(stop=""), "stop", "non-empty"),
    (minimal(stop=["a", 3]), "stop[1]", "valid string"),
    (minimal(top_logprobs=2), "top_logprobs", "'logprobs' must be true"),
    (minimal(logprobs=False, top_logprobs=0), "top_logprobs", "'logprobs' must be true"),
    (minimal(logit_bias={"abc": 1}), "logit_bias", "integer strings"),
    (minimal(logit_bias={"-1": 1}), "logit_bias", "integer strings"),
    (minimal(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (minimal(logit_bias={"5": "1"}), "logit_bias", "[-100, 100]"),
    (minimal(response_format={"type": "xml"}), "response_format", "not supported"),
    (minimal(seed="7"), "seed", "valid integer"),
    (minimal(max_tokens=1000.0), "max_tokens", "valid integer"),  # a float, not too large
    (minimal(user=5), "user", "valid string"),
    (minimal(messages="hi"), "messages", "valid list"),
    (minimal(messages=["hi"]), "messages[0]", "valid dictionary"),
]


@pytest.mark.parametrize("body,param,fragment", BAD, ids=[f"{p}-{i}" for i, (_, p, _f) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_param(body, param, fragment):
    with pytest.raises(APIError) as info:
        parse(copy.deepcopy(body))
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert fragment in err.message
    assert err.message.startswith(param)
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": None}}


UINT64_MAX, INT64_MIN = 2**64 - 1, -2**63
# A number out of range says its bound, with OpenAI's code. Written by stdlib json: orjson reads
# an integer past 64 bits back as a float (2**70 used to be "Input should be a valid integer").
BOUNDS = [
    ({"temperature": 2.5}, "temperature", "must be at most 2", "decimal_above_max_value"),
    ({"temperature": 5}, "temperature", "must be at most 2", "decimal_above_max_value"),
    ({"temperature": -0.1}, "temperature", "must be at least 0", "decimal_below_min_value"),
    ({"top_p": 0}, "top_p", "must be greater than 0", "decimal_below_min_value"),
    ({"top_p": 1.5}, "top_p", "must be at most 1", "decimal_above_max_value"),
    ({"presence_penalty": 2.1}, "presence_penalty", "must be at most 2", "decimal_above_max_value"),
    ({"frequency_penalty": -3}, "frequency_penalty", "must be at least -2",
     "decimal_below_min_value"),
    ({"n": 0}, "n", "must be at least 1", "integer_below_min_value"),
    ({"n": 17}, "n", "must be at most 16", "integer_above_max_value"),
    ({"n": 2**70}, "n", "must be at most 16", "integer_above_max_value"),
    ({"max_tokens": 0}, "max_tokens", "must be at least 1", "integer_below_min_value"),
    ({"max_tokens": -2**70}, "max_tokens", "must be at least 1", "integer_below_min_value"),
    ({"max_tokens": 2**70}, "max_tokens", f"must be at most {UINT64_MAX}",
     "integer_above_max_value"),
    ({"max_tokens": 2**64}, "max_tokens", f"must be at most {UINT64_MAX}",
     "integer_above_max_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "must be at least 1",
     "integer_below_min_value"),
    ({"max_completion_tokens": 10**30}, "max_completion_tokens",
     f"must be at most {UINT64_MAX}", "integer_above_max_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be at most 20",
     "integer_above_max_value"),
    ({"logprobs": True, "top_logprobs": 2**70}, "top_logprobs", "must be at most 20",
     "integer_above_max_value"),
    ({"top_k": -1}, "top_k", "must be at least 0", "integer_below_min_value"),
    ({"top_k": 2**70}, "top_k", f"must be at most {UINT64_MAX}", "integer_above_max_value"),
    ({"seed": 2**70}, "seed", f"must be at most {UINT64_MAX}", "integer_above_max_value"),
    ({"seed": -2**70}, "seed", f"must be at least {INT64_MIN}", "integer_below_min_value"),
    # orjson reads it as the float -2**63, the bound itself: still refused
    ({"seed": INT64_MIN - 1}, "seed", f"must be at least {INT64_MIN}", "integer_below_min_value"),
]


@pytest.mark.parametrize("patch,param,said,code", BOUNDS,
                         ids=[f"{p}-{i}" for i, (_, p, _s, _c) in enumerate(BOUNDS)])
def test_a_number_out_of_range_says_its_bound(patch, param, said, code):
    with pytest.raises(APIError) as info:
        parse_chat_request(json.dumps(minimal(**patch)).encode())
    assert info.value.status == 400
    assert info.value.body() == {"error": {"message": f"{param}: {said}", "param": param,
                                           "type": "invalid_request_error", "code": code}}


def test_the_64_bit_bounds_themselves_are_taken():
    req = parse_chat_request(json.dumps(minimal(seed=INT64_MIN, max_tokens=UINT64_MAX)).encode())
    assert (req.seed, req.max_tokens) == (INT64_MIN, UINT64_MAX)
    assert parse_chat_request(json.dumps(minimal(seed=UINT64_MAX)).encode()).seed == UINT64_MAX


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_response_format_is_unsupported(kind):
    with pytest.raises(APIError) as info:
        parse(minimal(response_format={"type": kind, "json_schema": {"name": "x", "schema": {}}}))
    assert info.value.status == 400
    assert info.value.body()["error"]["code"] == "unsupported_parameter"
    assert info.value.param == "response_format"
    assert "does not constrain output to JSON" in info.value.message


@pytest.mark.parametrize("raw", [b"", b"{", b"{'model': 1}", b"\xff\xfe", b"[[[" + b"]]"])
def test_invalid_json(raw):
    with pytest.raises(APIError) as info:
        parse_chat_request(raw)
    assert info.value.status == 400
    assert info.value.message.startswith("could not parse the JSON body: ")
    assert info.value.param is None


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"x"', b"null"])
def test_body_must_be_an_object(raw):
    with pytest.raises(APIError) as info:
        parse_chat_request(raw)
    assert info.value.status == 400
    assert "must be an object" in info.value.message


def test_api_error_body_shape():
    err = APIError(404, "no such model", type="not_found_error", param="model", code="model_not_found")
    assert err.status == 404
    assert err.body() == {"error": {"message": "no such model", "type": "not_found_error",
                                    "param": "model", "code": "model_not_found"}}


def test_ids():
    cid, tid = completion_id(), tool_call_id()
    assert cid.startswith("chatcmpl-") and len(cid) == len("chatcmpl-") + 24
    assert tid.startswith("call_") and len(tid) == len("call_") + 24
    assert completion_id() != cid


def test_chat_completion_shape():
    u = usage(10, 5, cached_tokens=4)
    assert u == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                 "prompt_tokens_details": {"cached_tokens": 4},
                 "completion_tokens_details": {"reasoning_tokens": 0}}
    c = choice(0, "hello", None, "stop", None)
    assert c == {"index": 0, "message": {"role": "assistant", "content": "hello", "refusal": None},
                 "logprobs": None, "finish_reason": "stop"}
    body = chat_completion("chatcmpl-x", 123, "m", [c], u)
    assert body == {"id": "chatcmpl-x", "object": "chat.completion", "created": 123, "model": "m",
                    "system_fingerprint": "rlproxy", "choices": [c], "usage": u}


def test_tool_call_choice_has_null_content():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    c = choice(1, "", calls, "tool_calls", None)
    assert c["message"] == {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    assert c["finish_reason"] == "tool_calls" and c["index"] == 1
    assert choice(0, "let me check", calls, "tool_calls", None)["message"]["content"] == "let me check"


def test_chunk_shape():
    d = delta_choice(0, {"role": "assistant", "content": "hi"})
    assert d == {"index": 0, "delta": {"role": "assistant", "content": "hi"},
                 "logprobs": None, "finish_reason": None}
    c = chunk("chatcmpl-x", 1, "m", [d])
    assert c == {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "system_fingerprint": "rlproxy", "choices": [d]}
    last = chunk("chatcmpl-x", 1, "m", [], usage=usage(1, 2))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 3
    assert delta_choice(2, {}, "length")["finish_reason"] == "length"


def test_token_logprob_shape():
    assert token_logprob("é".encode(), -0.5, [("é".encode(), -0.5), (b"e", -1.25)]) == {
        "token": "é", "logprob": -0.5, "bytes": [195, 169],
        "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                         {"token": "e", "logprob": -1.25, "bytes": [101]}]}
    # Half of a UTF-8 character: the text is a replacement mark, the bytes stay exact.
    assert token_logprob(b"\xc3", -1.0, [])["bytes"] == [195]
    assert orjson.loads(orjson.dumps(token_logprob(b"a", 0.0, []))) == {
        "token": "a", "logprob": 0.0, "bytes": [97], "top_logprobs": []}


def test_empty_tool_call_arguments_mean_no_arguments():
    req = parse_chat_request(orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]}))
    assert template_messages(req)[1]["tool_calls"][0]["function"]["arguments"] == {}


# ---- hostile values (issue 13): bounded depth, bounded messages, ids matched whole ----

def nested(depth: int, leaf=1, kind="list"):
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"a": leaf}
    return leaf


def test_json_depth_counts_containers_without_recursion():
    assert [json_depth(v) for v in (1, "x", [], {}, [[]], {"a": [1, {"b": {}}]})] == [
        0, 0, 1, 1, 2, 4]
    assert json_depth(nested(100_000)) == 100_000  # Python's recursion limit is 1,000


@pytest.mark.parametrize("depth,ok", [(64, True), (65, False), (2000, False)])
def test_body_deeper_than_the_limit_is_a_400(depth, ok):
    # the whole body counts: the root object and "tools" list add 2 levels
    body = minimal(tools=[{"type": "function", "function": {
        "name": "f", "parameters": nested(depth - 4, kind="dict")}}])
    raw = orjson.dumps(body) if depth < 250 else (
        b'{"model": "m", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}")
    if ok:
        assert json_depth(load_json(raw)) == depth
        return
    with pytest.raises(APIError) as info:
        load_json(raw)
    assert info.value.status == 400 and info.value.body()["error"]["code"] == "json_too_deep"
    assert "nested more than 64 levels" in info.value.message
    with pytest.raises(APIError):
        load_json(raw.replace(b"[" * 10, b"[" * 10, 1), max_depth=8)


def test_tool_call_arguments_are_held_to_the_depth_limit():
    # JSON inside a string escapes the body's check, and is recorded as an object (orjson
    # refuses to write past 254 levels)
    def body(args: str) -> dict:
        return minimal(messages=[{"role": "user", "content": "hi"}, {
            "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": args}}]}, {"role": "tool", "tool_call_id": "c",
                                                     "content": "ok"}])
    for depth in (100, 300, 5000):
        with pytest.raises(APIError) as info:
            parse(body('{"a": ' + "[" * depth + "]" * depth + "}"))
        assert info.value.param == "messages[1].tool_calls[0].function.arguments"
        assert "nested more than 64 levels" in info.value.message
    assert parse(body(orjson.dumps({"a": nested(60)}).decode()))
    with pytest.raises(APIError):
        parse_chat_request(orjson.dumps(body(orjson.dumps({"a": nested(20)}).decode())),
                           max_depth=16)


def test_error_messages_never_carry_unbounded_values():
    # Past the edge's depth check (a caller without one): the message is still short and built
    # without recursion, where repr() of these values overflowed the stack or ran to megabytes.
    deep, huge = nested(5000), "x" * 1_000_000
    for body, param in ((minimal(logit_bias={"5": deep}), "logit_bias"),
                        (minimal(logit_bias={"5": huge}), "logit_bias"),
                        (minimal(logit_bias={huge: 1}), "logit_bias"),
                        (minimal(messages=[{"role": "user", "content": [{"type": deep}]}]),
                         "messages[0].content"),
                        (minimal(messages=[{"role": "user", "content": [{"type": huge}]}]),
                         "messages[0].content"),
                        (minimal(response_format={"type": huge}), "response_format")):
        with pytest.raises(APIError) as info:
            validate(ChatRequest, body)
        assert info.value.status == 400 and info.value.param == param
        assert len(info.value.message) < 300, info.value.message[:400]
    with pytest.raises(APIError) as info:  # a client's dict key lands in the param
        validate(ResponsesRequest, {"model": "m", "input": "hi", "metadata": {huge: 1}})
    assert info.value.param.startswith("metadata.xxx") and len(info.value.param) < 60
    assert len(shown(deep)) <= 100 and len(shown(huge)) <= 100 and shown(10**5000) == "<int>"


@pytest.mark.parametrize("body,param", [
    (minimal(tools=[{"type": "function", "function": {"name": "get_weather\n"}}]),
     "tools[0].function.name"),
    (minimal(logit_bias={"5\n": 1}), "logit_bias"),
    (minimal(logit_bias={"1" * 5000: 1}), "logit_bias"),
    (minimal(logit_bias={"\u0665": 1}), "logit_bias"),  # an Arabic-Indic digit: not [0-9]
])
def test_ids_and_token_ids_are_matched_whole(body, param):
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.param == param


class Body:  # the body fallbacks parse_turn_tags reads
    session_id = turn_type = session_done = None


@pytest.mark.parametrize("name", ["X-Step-Index", "X-Hermes-Step-Index"])
@pytest.mark.parametrize("value", ["\u00b2", "1" * 4301, "18446744073709551616",
                                   "9223372036854775808", "-1", "1e3", "0x10", "", "\u0661"])
def test_step_index_is_ascii_digits_within_int64(name, value):
    with pytest.raises(APIError) as info:
        parse_turn_tags({name: value}, Body())
    assert info.value.status == 400 and info.value.param == name
    assert len(info.value.message) < 200


def test_step_index_accepts_int64():
    for value, want in (("0", 0), (" 7 ", 7), ("9223372036854775807", 2**63 - 1)):
        assert parse_turn_tags({"X-Step-Index": value}, Body()).step_index == want


@pytest.mark.parametrize("sid", ["abc\n", "abc\r\n", "\nabc", "a b", "x" * 129, "",
                                 "caf\u00e9", "a\x00"])
def test_session_id_is_matched_whole(sid):
    body = Body()
    body.session_id = sid
    for headers, fallback in (({"X-Session-Id": sid}, Body()), ({}, body)):
        if headers.get("X-Session-Id") == "":  # an empty header is no header
            continue
        with pytest.raises(APIError) as info:
            parse_turn_tags(headers, fallback)
        assert info.value.param == "X-Session-Id"
