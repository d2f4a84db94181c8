"""The OpenAI-compatible server over real HTTP, with the real openai SDK and the real tiny model."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import requests

from conftest import (
    HELLO_PROMPT, HELLO_REPLY, TOOL_PROMPT, TOOLS, ServerThread, make_settings,
)

MSG = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


def test_non_streaming_shape_and_usage(server):
    r = server.client().chat.completions.create(model="any-name", messages=MSG, max_tokens=7,
                                                seed=1)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "any-name"  # agents' own model names are served by the loaded model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 7
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 7


@pytest.mark.parametrize("max_tokens", [1, 5, 33])
def test_max_tokens_respected(server, max_tokens):
    r = server.client().chat.completions.create(model="m", messages=MSG, temperature=0,
                                                max_completion_tokens=max_tokens)
    assert r.usage.completion_tokens <= max_tokens
    assert r.choices[0].finish_reason == "length" or r.usage.completion_tokens < max_tokens


def test_same_seed_same_text_and_other_seed_differs(server):
    c = server.client()
    kw = dict(model="m", messages=MSG, temperature=0.9, max_tokens=24)
    a = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    other = c.chat.completions.create(seed=99, **kw).choices[0].message.content
    assert a == b and len(a) > 0
    assert other != a


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1])
def test_any_signed_or_unsigned_64_bit_seed_is_served_reproducibly(server, seed):
    kw = dict(model="m", messages=MSG, max_tokens=6, seed=seed, n=2)
    a = server.client().chat.completions.create(**kw)
    b = server.client().chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_temperature_zero_is_deterministic(server):
    c = server.client()
    texts = {c.chat.completions.create(model="m", messages=MSG, temperature=0,
                                       max_tokens=16).choices[0].message.content
             for _ in range(3)}
    assert len(texts) == 1


async def test_async_streaming_matches_non_streaming(server):
    c = server.async_client()
    kw = dict(model="m", messages=MSG, temperature=0.8, max_tokens=20, seed=7)
    full = await c.chat.completions.create(**kw)
    stream = await c.chat.completions.create(stream=True,
                                             stream_options={"include_usage": True}, **kw)
    pieces, finish, usage, chunks = [], None, None, 0
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            pieces.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert chunks >= 3  # real token-by-token streaming, not one blob


def test_logprobs_and_top_logprobs(server):
    r = server.client().chat.completions.create(model="m", messages=MSG, max_tokens=10,
                                                logprobs=True, top_logprobs=3, seed=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens  # the random model never ends early here
    joined = b"".join(bytes(e.bytes) for e in entries)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob <= tops[0] + 1e-5
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
    no_lp = server.client().chat.completions.create(model="m", messages=MSG, max_tokens=3)
    assert no_lp.choices[0].logprobs is None


def test_n_choices(server):
    r = server.client().chat.completions.create(model="m", messages=MSG, max_tokens=6, n=3,
                                                seed=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seed + i per choice
    # usage counts every choice's tokens; the prompt once
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    single = server.client().chat.completions.create(model="m", messages=MSG, max_tokens=1)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens


async def test_eight_concurrent_requests_complete(server):
    c = server.async_client()
    results = await asyncio.gather(*[
        c.chat.completions.create(model="m", messages=MSG, max_tokens=40, seed=i, stream=(i % 2 == 0))
        for i in range(8)
    ])
    for i, res in enumerate(results):
        if i % 2 == 0:
            text = "".join([ch.choices[0].delta.content or "" async for ch in res if ch.choices])
            assert text
        else:
            assert res.choices[0].finish_reason in ("length", "stop")
    health = requests.get(server.url + "/healthz").json()
    assert health["engine"]["active"] == 0


def test_tools_request_renders_tools(server):
    c = server.client()
    plain = c.chat.completions.create(model="m", messages=TOOL_PROMPT, max_tokens=2)
    with_tools = c.chat.completions.create(model="m", messages=TOOL_PROMPT, tools=TOOLS,
                                           max_tokens=2)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 30
    none = c.chat.completions.create(model="m", messages=TOOL_PROMPT, tools=TOOLS,
                                     tool_choice="none", max_tokens=2)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_history_with_tool_calls_and_results_is_accepted(server):
    messages = TOOL_PROMPT + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = server.client().chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                max_tokens=4)
    assert r.usage.prompt_tokens > 100


async def test_client_disconnect_mid_stream_leaves_server_healthy(server):
    body = {"model": "m", "messages": MSG, "max_tokens": 2000, "stream": True, "seed": 1}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.base_url + "/chat/completions", json=body)
        lines = 0
        async for _ in resp.content:
            lines += 1
            if lines >= 6:
                break
        resp.close()  # drop the connection mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        health = requests.get(server.url + "/healthz").json()
        if health["engine"]["active"] == 0:
            break
        await asyncio.sleep(0.1)
    assert health["status"] == "ok"
    assert health["engine"]["active"] == 0  # the abandoned generation was cancelled
    ok = server.client().chat.completions.create(model="m", messages=MSG, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_models_endpoints(server):
    c = server.client()
    ids = [m.id for m in c.models.list()]
    assert ids == ["rlproxy-embedded-tiny"]
    assert c.models.retrieve("rlproxy-embedded-tiny").id == "rlproxy-embedded-tiny"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


def test_healthz(server):
    h = requests.get(server.url + "/healthz").json()
    assert h["status"] == "ok"
    assert h["model"] == "rlproxy-embedded-tiny"
    assert isinstance(h["adapter_version"], int) and h["adapter_version"] == 0
    assert h["blas"]


def _post(server, body, raw=None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(server.base_url + "/chat/completions", data=data,
                         headers={"Content-Type": "application/json", **(headers or {})})


BAD_INPUTS = [
    ("invalid json", None, b"{not json", 400, None),
    ("not an object", None, b"[1, 2]", 400, None),
    ("no messages", {"model": "m", "messages": []}, None, 400, "messages"),
    ("bad role", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("wrong type", {"model": "m", "messages": MSG, "temperature": "hot"}, None, 400,
     "temperature"),
    ("max_tokens zero", {"model": "m", "messages": MSG, "max_tokens": 0}, None, 400,
     "max_tokens"),
    ("missing model", {"messages": MSG}, None, 400, "model"),
    ("image content", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, None, 400,
     "messages[0].content"),
    ("json mode", {"model": "m", "messages": MSG, "response_format": {"type": "json_object"}},
     None, 400, "response_format"),
    # max_tokens beyond the context is clamped by default, a 400 only with --strict-max-tokens:
    # tests/test_threads.py checks both.
    ("logit_bias past the vocabulary", {"model": "m", "messages": MSG, "max_tokens": 2,
                                        "logit_bias": {"999999": 5}}, None, 400, "logit_bias"),
]


@pytest.mark.parametrize("name,body,raw,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(server, name, body, raw, status, param):
    r = _post(server, body, raw)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert requests.get(server.url + "/healthz").json()["status"] == "ok"


def test_prompt_longer_than_context(server):
    huge = "word " * 70000  # ~140k tokens > the 131,072-token context
    r = _post(server, {"model": "m", "messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_sdk_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="m", messages=[])


UINT64_MAX, INT64_MIN = 2**64 - 1, -2**63
# Sent by the real openai SDK: a number out of range is said with its bound in OpenAI's shape,
# not "Input should be a valid integer" (orjson reads an integer past 64 bits as a float).
OUT_OF_RANGE = [
    ({"max_tokens": 2**70}, "max_tokens", f"must be at most {UINT64_MAX}",
     "integer_above_max_value"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", "must be at least 1",
     "integer_below_min_value"),
    ({"n": 2**70}, "n", "must be at most 16", "integer_above_max_value"),
    ({"seed": -2**70}, "seed", f"must be at least {INT64_MIN}", "integer_below_min_value"),
    ({"logprobs": True, "top_logprobs": 2**70}, "top_logprobs", "must be at most 20",
     "integer_above_max_value"),
    ({"temperature": 5}, "temperature", "must be at most 2", "decimal_above_max_value"),
    ({"extra_body": {"top_k": -2**70}}, "top_k", "must be at least 0", "integer_below_min_value"),
]


@pytest.mark.parametrize("kw,param,said,code", OUT_OF_RANGE,
                         ids=[f"{p}-{i}" for i, (_, p, _s, _c) in enumerate(OUT_OF_RANGE)])
def test_a_number_out_of_range_says_its_bound(server, kw, param, said, code):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="m", messages=MSG, **kw)
    assert e.value.status_code == 400 and (e.value.param, e.value.code) == (param, code)
    assert e.value.response.json() == {"error": {
        "message": f"{param}: {said}", "type": "invalid_request_error", "param": param,
        "code": code}}


def test_unknown_routes_and_ollama_probes_get_json_404(server):
    for method, path in [("POST", "/api/show"), ("GET", "/api/v1/models"), ("GET", "/nothing")]:
        r = requests.request(method, server.url + path)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"


def test_known_path_with_another_method_is_405_with_allow(server):
    r = requests.get(server.base_url + "/chat/completions")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


FEEDBACK_ERRORS = [
    ({"reward": 1, "turn": "last"}, "session_id", "session_id (string) is required"),
    ({"session_id": "", "reward": 1, "turn": "last"}, "session_id",
     "session_id (string) is required"),
    ({"session_id": "s", "reward": 2, "turn": "last"}, "reward", "reward: must be at most 1"),
    ({"session_id": "s", "reward": True, "turn": "last"}, "reward",
     "reward must be a number in [-1, 1]"),
    ({"session_id": "s", "reward": "1", "turn": "last"}, "reward",
     "reward must be a number in [-1, 1]"),
    ({"session_id": "s", "reward": 1, "turn": "last", "comment": 5}, "comment",
     "comment must be a string"),
    ({"session_id": "s", "reward": 1, "turn": "first"}, "turn", "turn may only be 'last'"),
    ({"session_id": "s", "reward": 1}, "turn",
     "name the turn: turn_uid, turn_index, turn_id (+ step_index) or turn: 'last'"),
    ({"session_id": "s", "reward": 1, "turn_uid": 5}, "turn_uid", "turn_uid must be a string"),
    ({"session_id": "s", "reward": 1, "turn_id": ["t"]}, "turn_id", "turn_id must be a string"),
    ({"session_id": "s", "reward": 1, "turn_index": "0"}, "turn_index",
     "turn_index must be an integer"),
    ({"session_id": "s", "reward": 1, "turn_index": 18446744073709551616}, "turn_index",
     "turn_index: must be at most 18446744073709551615"),  # an integer, too large
    ({"session_id": "s", "reward": 1, "turn_id": "t", "step_index": True}, "step_index",
     "step_index must be an integer"),
]


@pytest.mark.parametrize("body,param,message", FEEDBACK_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(FEEDBACK_ERRORS)])
def test_feedback_errors_name_the_field(server, body, param, message):
    r = requests.post(server.base_url + "/feedback", data=json.dumps(body))
    assert r.status_code == 400
    code = {"reward": "decimal_above_max_value", "turn_index": "integer_above_max_value"}.get(
        param) if ": must be" in message else None  # a bound's code: OpenAI's
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                 "param": param, "code": code}


def test_feedback_on_a_turn(server):
    r = server.client().chat.completions.with_raw_response.create(
        model="m", messages=MSG, max_tokens=2, extra_headers={"X-Session-Id": "fb-1"})
    uid = r.headers["X-Turn-Uid"]
    for names in ({"turn": "last", "comment": None}, {"turn_uid": uid}, {"turn_index": 0}):
        got = requests.post(server.base_url + "/feedback",
                            json={"session_id": "fb-1", "reward": 1, **names})
        assert got.status_code == 200, got.text
        assert got.json()["turn_uid"] == uid and got.json()["reward"] == 1.0
    missing = requests.post(server.base_url + "/feedback",
                            json={"session_id": "x" * 5000, "reward": 1, "turn": "last"})
    assert missing.status_code == 404 and len(missing.json()["error"]["message"]) < 200


def test_oversize_body_is_413(tiny, tmp_path):
    with ServerThread(make_settings(tmp_path, max_request_mb=0.01), tiny) as s:
        r = _post(s, {"model": "m", "messages": [{"role": "user", "content": "x" * 20000}]})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert s.client().chat.completions.create(model="m", messages=MSG, max_tokens=2)


def test_api_key_and_strict_model_names(tiny, tmp_path):
    settings = make_settings(tmp_path, api_key="sekret", strict_model_names=True,
                             served_model_name=["alias-a", "alias-b"])
    with ServerThread(settings, tiny) as s:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").chat.completions.create(model="alias-a", messages=MSG)
        assert requests.get(s.url + "/healthz").status_code == 200  # open for probes
        c = s.client(api_key="sekret")
        assert [m.id for m in c.models.list()] == ["alias-a", "alias-b"]
        assert c.chat.completions.create(model="alias-b", messages=MSG, max_tokens=2)
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
        assert e.value.body["code"] == "model_not_found"


def test_tool_call_is_parsed(taught_server):
    r = taught_server.client().chat.completions.create(
        model="m", messages=TOOL_PROMPT, tools=TOOLS, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


async def test_tool_call_streams_as_indexed_delta(taught_server):
    stream = await taught_server.async_client().chat.completions.create(
        model="m", messages=TOOL_PROMPT, tools=TOOLS, temperature=0, max_tokens=60, stream=True)
    calls, content, finish = [], "", None
    async for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        calls += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [c.index for c in calls] == [0]
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_tool_choice_none_leaves_markup_as_text(taught_server):
    # tool_choice "none": the tools are neither rendered nor parsed, as OpenAI specifies.
    r = taught_server.client().chat.completions.create(
        model="m", messages=TOOL_PROMPT, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=60)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_taught_reply_and_end_token(taught_server):
    r = taught_server.client().chat.completions.create(
        model="m", messages=HELLO_PROMPT, temperature=0, max_tokens=60)
    assert r.choices[0].message.content == HELLO_REPLY
    assert r.choices[0].finish_reason == "stop"  # the model's end token, not the length cap


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(taught_server, stream):
    kw = dict(model="m", messages=HELLO_PROMPT, temperature=0, max_tokens=60,
              stop=["city", "Paris"])
    c = taught_server.client()
    if stream:
        text, finish = "", None
        for chunk in c.chat.completions.create(stream=True, **kw):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    else:
        r = c.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == "Hello from "
    assert finish == "stop"


def test_logit_bias_steers_sampling(server, tiny):
    token = 300
    r = server.client().chat.completions.create(
        model="m", messages=MSG, max_tokens=5, seed=3, logprobs=True,
        logit_bias={str(token): 100})
    piece = tiny.tokenizer.decode([token]).encode()
    assert [bytes(e.bytes) for e in r.choices[0].logprobs.content] == [piece] * 5
