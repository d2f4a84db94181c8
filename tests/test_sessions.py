"""Sessions, next states, idempotency and records, over real HTTP with the real openai SDK."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest
import requests

from rlproxy.appkeys import SCORER, SESSIONS

from conftest import TOOL_PROMPT, TOOLS, ServerThread, make_settings, read_records, server_with

TOOL_RESULT = {"role": "tool", "tool_call_id": "", "content": '{"temperature": 21}'}


def end_session(server, sid: str) -> requests.Response:
    """POST /v1/sessions/{sid}/end; returns once the session's records are on disk (the store
    writes them on its writer threads)."""
    r = requests.post(f"{server.base_url}/sessions/{sid}/end")
    server.app[SESSIONS].flushed().result(timeout=30)
    return r


def assistant_message(choice) -> dict:
    """The assistant message an agent sends back: what the API returned, as the SDK gives it."""
    m = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        m["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name,
                                         "arguments": c.function.arguments}}
                           for c in choice.message.tool_calls]
    return m


def run_tool_session(server, headers_for_step):
    """Four model calls: tool call -> (tool result) -> answer -> (user) -> answer -> (user) ->
    answer. Returns the messages each step added after the previous assistant message."""
    c = server.client()
    messages = list(TOOL_PROMPT)
    added, session_ids = [], []
    followups = [None, {"role": "user", "content": "Thanks! And tomorrow?"},
                 {"role": "user", "content": "Great, that is all."}]
    for step in range(4):
        raw = c.chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=30,
            extra_headers=headers_for_step(step))
        session_ids.append(raw.headers["x-session-id"])
        choice = raw.parse().choices[0]
        messages.append(assistant_message(choice))
        if step == 0:
            assert choice.finish_reason == "tool_calls"
            new = [dict(TOOL_RESULT, tool_call_id=choice.message.tool_calls[0].id)]
        elif step < 3:
            new = [followups[step]]
        else:
            new = None
        if new:
            messages += new
        added.append(new)
    return added, session_ids


def turns_of(data_dir, session_id) -> list[dict]:
    return sorted((r for r in read_records(data_dir) if r["session_id"] == session_id),
                  key=lambda r: r["index"])


def check_links(turns, added):
    assert [t["index"] for t in turns] == [0, 1, 2, 3]
    for turn, expected in zip(turns, added):
        if expected is None:
            assert turn["next_state"] is None
        else:
            assert [(m["role"], m["content"]) for m in turn["next_state"]] == \
                [(m["role"], m["content"]) for m in expected]
            assert turn["next_state_link"] == "prefix"
    assert turns[0]["choices"][0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turns[1]["next_state"][0]["role"] == "user"


def test_tool_use_session_with_headers(taught_server):
    sid = "sess-headers-1"

    def headers(step):
        h = {"X-Session-Id": sid, "X-Turn-Id": f"t{min(step, 1)}", "X-Step-Index": str(step)}
        if step == 3:
            h["X-Session-Done"] = "true"
        return h

    added, ids = run_tool_session(taught_server, headers)
    assert set(ids) == {sid}
    turns = turns_of(taught_server.settings.records.data_dir, sid)
    check_links(turns, added)
    assert turns[3]["end"] == "session_done"
    assert [t["step_index"] for t in turns] == [0, 1, 2, 3]
    assert turns[2]["turn_id"] == "t1"
    session = requests.get(f"{taught_server.base_url}/sessions/{sid}").json()
    assert session["open"] is False and session["closed"] == "session_done"


def test_same_conversation_without_headers_links_the_same(taught_server):
    added, ids = run_tool_session(taught_server, lambda step: {})
    assert len(set(ids)) == 1 and ids[0].startswith("auto-")  # one inferred session
    r = end_session(taught_server, ids[0])
    assert r.status_code == 200
    turns = turns_of(taught_server.settings.records.data_dir, ids[0])
    check_links(turns, added)
    assert turns[3]["end"] == "ended"


fresh = server_with(scope="function")  # a server per test


def test_request_id_retry_returns_stored_response(fresh):
    c = fresh.client()
    kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
              extra_headers={"X-Session-Id": "idem", "X-Request-Id": "req-1"})
    first = c.chat.completions.with_raw_response.create(**kw)
    again = c.chat.completions.with_raw_response.create(**kw)
    assert again.headers.get("x-idempotent-replay") == "true"
    assert again.parse().model_dump() == first.parse().model_dump()
    # a streaming retry of the same id replays the same text
    stream = c.chat.completions.create(stream=True, **kw)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == first.parse().choices[0].message.content
    # streamed first, retried streamed: identical bytes
    body = {"model": "m", "messages": kw["messages"], "max_tokens": 12, "stream": True}
    h = {"X-Session-Id": "idem", "X-Request-Id": "req-2"}
    one = requests.post(fresh.base_url + "/chat/completions", json=body, headers=h).content
    two = requests.post(fresh.base_url + "/chat/completions", json=body, headers=h).content
    assert one == two and b"[DONE]" in one
    end_session(fresh, "idem")
    records = read_records(fresh.settings.records.data_dir)
    assert sorted(r["request_id"] for r in records) == ["req-1", "req-2"]  # no turn twice


def test_side_turns_are_recorded_but_never_queued_for_training(fresh):
    c = fresh.client()
    msgs = [{"role": "user", "content": "hi"}]
    for turn_type in ["main", "side", "side", "main"]:
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                      extra_headers={"X-Session-Id": "s-side",
                                                     "X-Turn-Type": turn_type})
        msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                       {"role": "user", "content": f"more {turn_type}"}]
    end_session(fresh, "s-side")
    records = read_records(fresh.settings.records.data_dir)
    assert sorted(r["turn_type"] for r in records) == ["main", "main", "side", "side"]
    assert all(r["trainable"] == (r["turn_type"] == "main") for r in records)
    side = {r["uid"] for r in records if r["turn_type"] == "side"}
    main = {r["uid"] for r in records if r["turn_type"] == "main"}
    scorer = fresh.app[SCORER]
    assert scorer.known == main and not side & scorer.known  # side turns never queued


def test_opt_out_is_served_and_never_written(fresh):
    c = fresh.client()
    raw = c.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "private"}], max_tokens=4,
        extra_headers={"X-Session-Id": "s-opt", "X-RL-Opt-Out": "1"})
    assert raw.parse().choices[0].message.content is not None
    assert "x-session-id" not in raw.headers
    assert requests.get(fresh.base_url + "/sessions/s-opt").status_code == 404
    data_dir = fresh.settings.records.data_dir
    assert read_records(data_dir) == [] and read_records(data_dir, "pending_turns.jsonl") == []


def test_idle_timeout_closes_session(tiny, tmp_path):
    with ServerThread(make_settings(tmp_path, session_idle_timeout_s=0.4), tiny) as s:
        s.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=3, extra_headers={"X-Session-Id": "idle"})
        deadline = time.time() + 10
        while time.time() < deadline:
            info = requests.get(s.base_url + "/sessions/idle").json()
            if not info["open"]:
                break
            time.sleep(0.1)
        assert info["closed"] == "idle_timeout"
        s.app[SESSIONS].flushed().result(timeout=30)
        (record,) = read_records(tmp_path)
        assert record["next_state"] is None and record["end"] == "idle_timeout"
        assert requests.get(s.url + "/healthz").json()["sessions_open"] == 0


def test_interleaved_sessions_never_mix(fresh):
    c = fresh.client()
    convs = {name: [{"role": "system", "content": "shared system prompt"},
                    {"role": "user", "content": f"question from {name}"}]
             for name in ["hdr-a", "hdr-b", "auto-1", "auto-2"]}
    inferred = {}
    for round_ in range(3):
        for name, msgs in convs.items():
            headers = {"X-Session-Id": name} if name.startswith("hdr") else {}
            raw = c.chat.completions.with_raw_response.create(
                model="m", messages=msgs, max_tokens=5, seed=round_, extra_headers=headers)
            sid = raw.headers["x-session-id"]
            if name.startswith("auto"):
                assert inferred.setdefault(name, sid) == sid  # stays in its own session
            msgs += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                     {"role": "user", "content": f"{name} round {round_}"}]
    assert len({*inferred.values()}) == 2
    records = read_records(fresh.settings.records.data_dir)
    sessions = {"hdr-a": "hdr-a", "hdr-b": "hdr-b", **inferred}
    for name, sid in sessions.items():
        turns = sorted((r for r in records if r["session_id"] == sid), key=lambda r: r["index"])
        assert len(turns) == 2  # the third is still pending
        for i, t in enumerate(turns):
            assert t["next_state"] == [{"role": "user", "content": f"{name} round {i}"}]
            assert t["messages"][1]["content"] == f"question from {name}"


@pytest.mark.parametrize("headers,param", [
    ({"X-Session-Id": "has space"}, "X-Session-Id"),
    ({"X-Session-Id": "x" * 129}, "X-Session-Id"),
    ({"X-Turn-Type": "background"}, "X-Turn-Type"),
    ({"X-Session-Done": "maybe"}, "X-Session-Done"),
    ({"X-Step-Index": "two"}, "X-Step-Index"),
    ({"X-RL-Opt-Out": "perhaps"}, "X-RL-Opt-Out"),
])
def test_invalid_session_headers_are_400(fresh, headers, param):
    r = requests.post(fresh.base_url + "/chat/completions", headers=headers,
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_body_fallbacks_and_hermes_headers(fresh):
    c = fresh.client()
    msgs = [{"role": "user", "content": "hi"}]
    plain = c.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                      extra_headers={"X-RL-Opt-Out": "1"})
    raw = c.chat.completions.with_raw_response.create(
        model="m", messages=msgs, max_tokens=2,
        extra_body={"session_id": "body-sess", "turn_type": "side", "session_done": True},
        extra_headers={"X-Hermes-Outer-Turn-Id": "outer-7", "X-Hermes-Step-Index": "3",
                       "X-Hermes-Request-Id": "hermes-req-1"})
    assert raw.headers["x-session-id"] == "body-sess"
    assert raw.parse().usage.prompt_tokens == plain.usage.prompt_tokens  # fallbacks not templated
    (record,) = read_records(fresh.settings.records.data_dir)
    assert (record["session_id"], record["turn_type"]) == ("body-sess", "side")
    assert (record["turn_id"], record["step_index"], record["request_id"]) == \
        ("outer-7", 3, "hermes-req-1")
    assert "session_id" not in json.dumps(record["messages"])
    assert requests.get(fresh.base_url + "/sessions/body-sess").json()["closed"] == "session_done"


def test_recorded_tokens_reproduce_logprobs_and_text(tiny, tmp_path):
    """Token fidelity: the recorded prompt ids + completion ids, run through the same model,
    give the recorded behaviour logprobs, and decode to the text that was returned."""
    with ServerThread(make_settings(tmp_path), tiny) as s:
        c = s.client()
        msgs = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three colours. é ü 日本"}]
        returned = []
        for temperature, top_p, n in [(0.7, 0.9, 1), (1.3, 1.0, 2), (0.0, 1.0, 1)]:
            r = c.chat.completions.create(model="m", messages=msgs, max_tokens=24, seed=11,
                                          temperature=temperature, top_p=top_p, n=n,
                                          extra_headers={"X-Session-Id": "fidelity"})
            returned.append([ch.message.content for ch in r.choices])
            msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                           {"role": "user", "content": "again"}]
        end_session(s, "fidelity")
    records = sorted(read_records(tmp_path), key=lambda r: r["index"])
    assert len(records) == 3
    tok = tiny.tokenizer
    for record, texts in zip(records, returned):
        for choice, text in zip(record["choices"], texts):
            ids = choice["completion_ids"]
            full = mx.array(record["prompt_ids"] + ids)[None]
            logits = tiny.model(full)[0, len(record["prompt_ids"]) - 1:-1]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            recomputed = mx.take_along_axis(lp, mx.array(ids)[:, None], axis=1)[:, 0]
            assert mx.allclose(recomputed, mx.array(choice["logprobs"]), atol=1e-4).item()
            assert choice["adapter_versions"] == [0] * len(ids)
            shown = [i for i in ids if i not in tok.eos_token_ids]
            assert tok.decode(shown) == text
