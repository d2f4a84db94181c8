"""Threads inside sessions, side-call rules, compaction, the max_tokens clamp and reasoning
output: the agents' real call patterns replayed by hand through the real openai SDK against
the real server, plus the session store and ChoiceText driven directly with real parts."""

from __future__ import annotations

import dataclasses
import uuid

import anthropic
import pytest
import requests
from mlx_lm.tokenizer_utils import load as load_tokenizer
from transformers import AutoTokenizer

from rlproxy.api.tags import TurnTags
from rlproxy.appkeys import MODEL, SCORER, SESSIONS
from rlproxy.serving.choice_text import ChoiceText, model_thinks, prompt_opens_reasoning, \
    reasoning_markers
from rlproxy.serving.embedded_model import embedded_model_path
from rlproxy.sessions.store import SessionStore
from rlproxy.sessions.threads import system_key
from rlproxy.sessions.turn import Turn

from conftest import TOOL_PROMPT, TOOLS, ServerThread, make_settings, read_records, server_with

# ---- ChoiceText: reasoning split from content, token by token, with the real tokenizer ----

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def end_session(server, sid: str) -> requests.Response:
    """POST /v1/sessions/{sid}/end; returns once the session's records are on disk (the store
    writes them on its writer threads)."""
    r = requests.post(f"{server.base_url}/sessions/{sid}/end")
    server.app[SESSIONS].flushed().result(timeout=30)
    return r


def run_text(tok, text, *, tools=False, stop=None, reasoning=True, in_reasoning=False):
    markers = reasoning_markers(tok) if reasoning else None
    ct = ChoiceText(tok, stop, tools, markers, in_reasoning)
    deltas = [d for i in tok.encode(text, add_special_tokens=False) for d in ct.add(i)]
    if not ct.stopped:
        deltas += ct.finish()
    joined = {k: "".join(v for kind, v in deltas if kind == k) for k in ("content", "reasoning")}
    assert joined == {"content": ct.text, "reasoning": ct.reasoning}  # deltas add up
    assert not any("think>" in v for kind, v in deltas if kind == "content" and reasoning)
    return ct, deltas


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny.tokenizer


def test_reasoning_then_tool_call(tok):
    ct, deltas = run_text(tok, "<think>The user wants weather; call the tool.</think>\n\n" + CALL,
                          tools=True)
    assert ct.reasoning == "The user wants weather; call the tool."
    assert ct.text == ""
    assert [c["function"]["name"] for c in ct.tool_calls] == ["get_weather"]
    kinds = [k for k, _ in deltas]
    assert kinds.index("tool_call") > max(i for i, k in enumerate(kinds) if k == "reasoning")


@pytest.mark.parametrize("text,kw,reasoning,content", [
    ("<think>a plan</think>\n\nThe answer.", {}, "a plan", "The answer."),
    ("\n<think>lead</think>done", {}, "lead", "done"),  # whitespace before the marker
    ("Hello <think>not at the start</think>", {}, "", "Hello <think>not at the start</think>"),
    ("<think>x</think>y", {"reasoning": False}, "", "<think>x</think>y"),  # --reasoning-parser none
    ("opened by the prompt</think>\n\nAnswer.", {"in_reasoning": True},
     "opened by the prompt", "Answer."),
    ("never closed, cut by length", {"in_reasoning": True}, "never closed, cut by length", ""),
    ("<think>maybe " + CALL + "</think>Fine.", {"tools": True}, "maybe " + CALL, "Fine."),
    ("<think>abc STOP def</think>x", {"stop": ["STOP"]}, "abc ", ""),  # stops apply inside
    ("<thin", {}, "", "<thin"),  # a partial marker at the end is content after all
])
def test_reasoning_split(tok, text, kw, reasoning, content):
    ct, _ = run_text(tok, text, **kw)
    assert (ct.reasoning, ct.text) == (reasoning, content)
    assert ct.tool_calls == []  # a tool call inside reasoning is not parsed


def test_leading_blank_lines_stream_at_once_from_a_model_that_cannot_think(tok, thinking_model):
    """Whitespace is held back (a think marker may follow it) only for a model that can think:
    the tiny model's template and vocabulary have no marker, so a reply that opens with blank
    lines shows them as they are sampled, not all at its end."""
    markers = reasoning_markers(tok)
    assert not model_thinks(tok, markers)
    assert model_thinks(thinking_model.tokenizer, reasoning_markers(thinking_model.tokenizer))
    newline = tok.encode("\n", add_special_tokens=False)
    plain = ChoiceText(tok, None, False, markers, False, thinks=False)
    assert plain.add(newline[0]) == [("content", "\n")]
    held = ChoiceText(tok, None, False, markers, False, thinks=True)
    assert held.add(newline[0]) == []  # a thinking model's blank start waits for the marker
    # at the very start, the marker still opens a think block for any model
    ct = ChoiceText(tok, None, False, markers, False, thinks=False)
    deltas = [d for i in tok.encode("<think>plan</think>Hi", add_special_tokens=False)
              for d in ct.add(i)] + ct.finish()
    assert (ct.reasoning, ct.text) == ("plan", "Hi") and deltas


def test_prompt_that_opens_the_think_block(tok):
    def opens(suffix):
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                      add_generation_prompt=True)
        return prompt_opens_reasoning(tok, ids + tok.encode(suffix, add_special_tokens=False),
                                      reasoning_markers(tok))
    assert opens("<think>\n")
    assert not opens("<think>\n\n</think>\n\n")  # thinking switched off by the template
    assert not opens("")
    quoted = tok.apply_chat_template([{"role": "user", "content": "write <think>"}],
                                     add_generation_prompt=True)
    assert not prompt_opens_reasoning(tok, quoted, reasoning_markers(tok))


def test_think_markers_from_mlx_lm_metadata(tmp_path):
    """A vocabulary with single-token think markers (as Qwen3's): mlx-lm's TokenizerWrapper
    knows them, and the split works on those tokens too."""
    hf = AutoTokenizer.from_pretrained(embedded_model_path("tiny"))
    hf.add_tokens(["<think>", "</think>"])
    hf.save_pretrained(tmp_path)
    wrapped = load_tokenizer(tmp_path)
    assert wrapped.has_thinking and reasoning_markers(wrapped) == ("<think>", "</think>")
    assert len(wrapped.encode("<think>", add_special_tokens=False)) == 1
    ct, _ = run_text(wrapped, "<think>plan it</think>\n" + CALL, tools=True)
    assert (ct.reasoning, ct.text, len(ct.tool_calls)) == ("plan it", "", 1)


# ---- the session store on its own: thread hints and restarts ----

def file_turn(store, place, messages, reply, tools=None):
    turn = Turn(uid=uuid.uuid4().hex, session_id=place.session.id,
                index=store.next_index(place.session), turn_type=place.turn_type,
                requested_model="m", messages=messages, tools=tools, prompt_ids=[1, 2],
                choices=[{"index": 0, "seed": 0, "completion_ids": [3], "logprobs": [-0.5],
                          "adapter_versions": [0], "finish_reason": "stop", "text": reply,
                          "tool_calls": []}],
                sampling={}, timings={})
    store.complete(place, turn, False).result()  # on disk, as before a reply
    return turn


def test_thread_hint_continues_a_chain_without_a_session_header(tmp_path):
    store = SessionStore(tmp_path, idle_timeout_s=60, fsync=False)
    first = [{"role": "user", "content": "hi"}]
    place = store.resolve(TurnTags(session_id="s"), first)
    t0 = file_turn(store, place, first, "hello")
    follow = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    unhinted = store.resolve(TurnTags(), follow)  # header-less: header sessions are not matched
    assert unhinted.session.id != "s"
    hinted = store.resolve(TurnTags(), follow, thread_hint=t0.thread)
    assert (hinted.session.id, hinted.thread.id) == ("s", t0.thread)
    assert t0.next_state == [{"role": "user", "content": "?"}] and t0.next_state_link == "prefix"
    assert store.resolve(TurnTags(), first, thread_hint="th-unknown").session.id != "s"
    store.close()


def test_threads_survive_a_restart(tmp_path):
    store = SessionStore(tmp_path, idle_timeout_s=60, fsync=False)
    sys = {"role": "system", "content": "agent"}
    a = [sys, {"role": "user", "content": "task A"}]
    b = [sys, {"role": "user", "content": "task B"}]
    ta = file_turn(store, store.resolve(TurnTags(session_id="s"), a, TOOLS), a, "on A", TOOLS)
    tb = file_turn(store, store.resolve(TurnTags(session_id="s"), b, TOOLS), b, "on B", TOOLS)
    assert ta.thread != tb.thread
    store.close()

    store = SessionStore(tmp_path, idle_timeout_s=60, fsync=False)  # a restart
    more_b = b + [{"role": "assistant", "content": "on B"}, {"role": "user", "content": "B2"}]
    place = store.resolve(TurnTags(session_id="s"), more_b, TOOLS)
    assert place.thread.id == tb.thread and not place.opened
    store.flushed().result()
    session = store.find("s").summary(with_turns=True)
    assert {t["id"] for t in session["threads"]} == {ta.thread, tb.thread}
    linked = [r for r in read_records(tmp_path) if r["uid"] == tb.uid]
    assert linked[0]["next_state"] == [{"role": "user", "content": "B2"}]
    assert not [r for r in read_records(tmp_path) if r["uid"] == ta.uid]  # A still pending
    store.close()


def test_title_call_that_arrives_first_is_side_once_the_real_turn_is_there(tmp_path):
    store = SessionStore(tmp_path, idle_timeout_s=60, fsync=False)
    tags = TurnTags(session_id="s")
    title = [{"role": "system", "content": "title generator"}, {"role": "user", "content": "q"}]
    real = [{"role": "system", "content": "agent"}, {"role": "user", "content": "q"}]
    t_place = store.resolve(tags, title)  # nothing else in the session yet: main so far
    assert t_place.turn_type == "main"
    r_place = store.resolve(tags, real, TOOLS)
    real_turn = file_turn(store, r_place, real, "answer", TOOLS)
    title_turn = file_turn(store, t_place, title, "a title")  # finishes after the real one
    assert (title_turn.turn_type, title_turn.side_rule) == ("side", "aside")
    assert (real_turn.turn_type, real_turn.end) == ("main", None)
    store.close()


def test_claude_code_billing_line_is_not_part_of_the_system_prompt():
    """Claude Code 2.1.197 starts its system prompt with a line whose suffix follows the first
    user message, so it changes when a compaction rewrites that message."""
    def key(version):
        return system_key([{"role": "system", "content": f"x-anthropic-billing-header: "
                            f"cc_version=2.1.197.{version}; cc_entrypoint=sdk-cli;\n\nYou are"}])
    assert key("123") == key("84c") == system_key([{"role": "system", "content": "You are"}])
    assert key("123") != system_key([{"role": "system", "content": "You are not"}])


def test_rewrites_sub_agents_and_compactions(tmp_path):
    """Same agent, same first request, longer, edited history: the same thread (linked after
    its last assistant message). Another system prompt with tools (a sub-agent): a thread of
    its own, nothing closed. Same agent, shorter, a new first user message: a compaction."""
    store = SessionStore(tmp_path, idle_timeout_s=60, fsync=False)
    tags, sys = TurnTags(session_id="s"), {"role": "system", "content": "agent"}
    first = [sys, {"role": "user", "content": "fix the bug"}]
    t0 = file_turn(store, store.resolve(tags, first, TOOLS), first, "looking", TOOLS)
    edited = first + [{"role": "assistant", "content": "looking (edited by the agent)"},
                      {"role": "user", "content": "and?"}]
    place = store.resolve(tags, edited, TOOLS)
    assert place.thread.id == t0.thread and not place.opened
    assert t0.next_state == [{"role": "user", "content": "and?"}]
    assert t0.next_state_link == "after_last_assistant"
    t1 = file_turn(store, place, edited, "found it", TOOLS)
    sub = [{"role": "system", "content": "You are a search sub-agent"},
           {"role": "user", "content": "find the bug"}]
    s0 = file_turn(store, store.resolve(tags, sub, TOOLS), sub, "found", TOOLS)
    assert s0.thread != t1.thread and s0.turn_type == "main" and t1.end is None
    summary = [sys, {"role": "user", "content": "Summary of the conversation so far: ..."}]
    place = store.resolve(tags, summary, TOOLS)
    assert place.thread.compacts == t1.thread and t1.end == "compacted"
    assert store.find("s").threads[s0.thread].closed is None  # the sub-agent goes on
    store.close()


# ---- the agents' call patterns over real HTTP ----

TOOL_RESULT = '{"temperature": 21}'
# The agents' own system prompts are left out of their main threads: the taught adapter answers
# TOOL_PROMPT with a tool call reliably only as it was taught, without one (a system prompt
# changes the prompt, and a freshly trained adapter then may or may not call the tool). The
# rules only compare system prompts, so "none" vs a title generator's works the same; the store
# tests above cover compaction under a system prompt.
OC_TITLE = ("You are a title generator. You output ONLY a thread title, nothing else. "
            "Generate a brief title that captures the user's request.")
CC_TOPIC = ("Analyze if this message indicates a new conversation topic. Format your response "
            'as a JSON object with two fields: "isNewTopic" and "title".')
CC_SUMMARY = "Summarize this coding conversation in under 50 characters."


def no_eos(server) -> dict:
    """logit_bias that keeps the tiny model from ending early: a side call that runs long."""
    return {str(t): -100 for t in server.app[MODEL].tokenizer.eos_token_ids}


def assistant(msg) -> dict:
    """The assistant message an agent sends back: what the API returned."""
    m = {"role": "assistant", "content": msg.content}
    if msg.tool_calls:
        m["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name,
                                         "arguments": c.function.arguments}}
                           for c in msg.tool_calls]
    return m


def streamed_assistant(chunks) -> dict:
    """The same, put together from a stream's deltas."""
    m = {"role": "assistant", "content": "", "tool_calls": []}
    for chunk in chunks:
        for choice in chunk.choices:
            m["content"] += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                m["tool_calls"].append({"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments}})
    if not m["tool_calls"]:
        del m["tool_calls"]
    return m


def after(m: dict, follow_up: str) -> list[dict]:
    """What an agent adds after a reply: tool results for its calls, else the user's words."""
    if m.get("tool_calls"):
        return [{"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT}
                for c in m["tool_calls"]]
    return [{"role": "user", "content": follow_up}]


def session_records(server, sid) -> list[dict]:
    return sorted((r for r in read_records(server.settings.records.data_dir)
                   if r["session_id"] == sid), key=lambda r: r["index"])


def same(a: list[dict] | None, b: list[dict]) -> bool:
    return a is not None and [(m["role"], m["content"]) for m in a] == \
        [(m["role"], m["content"]) for m in b]


def overlapped(first, second):
    """Start `first` (a streaming call), wait for its first chunk (the server has filed it into
    its session and thread by then), run `second` to its end, then finish `first`: the overlap
    an agent's concurrent title call and real turn make."""
    chunks = iter(first())
    head = next(chunks)
    done = second()
    return [head, *chunks], done


def check_side(server, records, rules):
    side = [r for r in records if r["turn_type"] == "side"]
    assert sorted(r["side_rule"] for r in side) == sorted(rules)
    assert not any(r["trainable"] for r in side)
    known = server.app[SCORER].known  # every turn ever handed to scoring (and so training)
    assert not {r["uid"] for r in side} & known
    assert {r["uid"] for r in records if r["turn_type"] == "main"} <= known
    assert not any(r["end"] == "superseded" for r in records)
    return side


@pytest.mark.parametrize("title_first", [True, False])
def test_opencode_pattern(taught_server, title_first):
    """OpenCode 1.18: its own session id, and a title call (other system prompt, no tools)
    running at the same time as the real, tool-using turn; in either order of arrival."""
    c, sid = taught_server.client(), f"ses_{uuid.uuid4().hex[:12]}"
    h = {"X-Session-Id": sid}
    real = list(TOOL_PROMPT)
    title = [{"role": "system", "content": OC_TITLE},
             {"role": "user", "content": "Generate a title for: " + TOOL_PROMPT[0]["content"]}]

    def title_call(stream):  # long enough to still run when the real turn arrives
        return c.chat.completions.create(model="m", messages=title, max_tokens=300, stream=stream,
                                         logit_bias=no_eos(taught_server), extra_headers=h)

    def real_call(messages, stream=False):
        return c.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                         temperature=0, max_tokens=30, stream=stream,
                                         extra_headers=h)

    if title_first:
        _, first = overlapped(lambda: title_call(True), lambda: real_call(real))
        m1 = assistant(first.choices[0].message)
    else:
        chunks, _ = overlapped(lambda: real_call(real, stream=True), lambda: title_call(False))
        m1 = streamed_assistant(chunks)
    assert m1["tool_calls"][0]["function"]["name"] == "get_weather"
    added = [after(m1, "")]
    messages = real + [m1] + added[0]
    m2 = assistant(real_call(messages).choices[0].message)
    added.append(after(m2, "Thanks, that is all."))
    real_call(messages + [m2] + added[1])
    info = requests.get(f"{taught_server.base_url}/sessions/{sid}").json()
    assert end_session(taught_server, sid).status_code == 200

    records = session_records(taught_server, sid)
    (side,) = check_side(taught_server, records, ["aside"])
    main = [r for r in records if r["turn_type"] == "main"]
    assert len(main) == 3 and len({r["thread"] for r in main}) == 1
    assert side["thread"] != main[0]["thread"]
    for turn, expected in zip(main, added):
        assert same(turn["next_state"], expected) and turn["next_state_link"] == "prefix"
    assert main[-1]["next_state"] is None and main[-1]["end"] == "ended"
    threads = {t["id"]: t for t in info["threads"]}
    assert threads[main[0]["thread"]] | {"last_turn": None} == {
        "id": main[0]["thread"], "open": True, "closed": None, "main": True, "tools": True,
        "turns": 3, "last_turn": None, "pending": main[-1]["uid"], "compacts": None}
    assert threads[side["thread"]]["main"] is False
    assert {t["uid"]: t["thread"] for t in info["turn_list"]} == \
        {r["uid"]: r["thread"] for r in records}


def test_claude_code_pattern(taught_server):
    """Claude Code: a max_tokens=1 quota probe, topic detection beside the first turn, four
    tool-using turns, a compaction (a new prompt: the system prompt, none here, and a summary),
    a turn after it, and a summary call."""
    c, sid = taught_server.client(), f"cc-{uuid.uuid4().hex[:12]}"
    h = {"X-Session-Id": sid}

    def call(messages, tools=TOOLS, **kw):
        kw = {"temperature": 0, "max_tokens": 30, **kw}
        if tools:
            kw["tools"] = tools
        return c.chat.completions.create(model="m", messages=messages, extra_headers=h, **kw)

    probe = call([{"role": "user", "content": "quota"}], tools=None, max_tokens=1,
                 logit_bias=no_eos(taught_server))
    assert probe.choices[0].finish_reason == "length"
    messages = list(TOOL_PROMPT)
    topic = [{"role": "system", "content": CC_TOPIC}, TOOL_PROMPT[0]]
    _, first = overlapped(
        lambda: call(topic, tools=None, max_tokens=300, stream=True,
                     logit_bias=no_eos(taught_server)),
        lambda: call(messages))
    replies, added = [assistant(first.choices[0].message)], []
    assert replies[0]["tool_calls"]
    for step in range(1, 4):
        added.append(after(replies[-1], f"Now step {step}: What is the weather in Paris?"))
        messages = messages + [replies[-1]] + added[-1]
        replies.append(assistant(call(messages).choices[0].message))
    assert added[0][0]["role"] == "tool"  # the first next state is the tool's result
    summary = ("This session is being continued from a previous conversation that ran out of "
               "context. Summary of the conversation so far: the user asked for the weather "
               "in Paris; get_weather said 21 degrees.")
    compacted = [{"role": "user", "content": summary}]  # the system prompt (none) + summary
    reply = assistant(call(compacted).choices[0].message)
    call(compacted + [reply] + after(reply, "Continue."))
    call([{"role": "system", "content": CC_SUMMARY},
          {"role": "user", "content": "Summarize: " + summary}], tools=None)
    info = requests.get(f"{taught_server.base_url}/sessions/{sid}").json()
    end_session(taught_server, sid)

    records = session_records(taught_server, sid)
    check_side(taught_server, records, ["probe", "aside", "aside"])
    main = [r for r in records if r["turn_type"] == "main"]
    old, new = main[:4], main[4:]
    assert len(new) == 2 and len({r["thread"] for r in old}) == 1
    assert len({r["thread"] for r in new}) == 1 and new[0]["thread"] != old[0]["thread"]
    for turn, expected in zip(old, added):  # each main turn -> its next state, own thread
        assert same(turn["next_state"], expected) and turn["next_state_link"] == "prefix"
    assert old[3]["next_state"] is None and old[3]["end"] == "compacted"
    assert same(new[0]["next_state"], after(reply, "Continue.")) and new[1]["end"] == "ended"
    threads = {t["id"]: t for t in info["threads"]}
    assert threads[old[0]["thread"]]["closed"] == "compacted"
    assert threads[old[0]["thread"]]["turns"] == 4
    assert threads[new[0]["thread"]]["compacts"] == old[0]["thread"]
    assert threads[new[0]["thread"]]["open"] and threads[new[0]["thread"]]["turns"] == 2
    assert len(threads) == 5  # probe, topic, the first thread, its compaction, summary


def test_turn_type_header_overrides_the_rules(fresh):
    c, sid = fresh.client(), "override"
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]

    def call(messages, turn_type=None, **kw):
        h = {"X-Session-Id": sid, **({"X-Turn-Type": turn_type} if turn_type else {})}
        raw = c.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=kw.pop("max_tokens", 3),
            extra_headers=h, **kw)
        return raw.headers["x-turn-uid"]

    uids = [call(msgs, tools=TOOLS),
            call([{"role": "user", "content": "title?"}], "main"),  # aside, but said main
            call([{"role": "user", "content": "ping"}], "main", max_tokens=1),  # probe: main
            call([{"role": "user", "content": "ping"}], max_tokens=1),
            call(msgs, "side", tools=TOOLS)]  # a tool-using call said to be side
    end_session(fresh, sid)
    by_uid = {r["uid"]: r for r in read_records(fresh.settings.records.data_dir)}
    got = [(by_uid[u]["turn_type"], by_uid[u]["side_rule"]) for u in uids]
    assert got == [("main", None), ("main", None), ("main", None), ("side", "probe"),
                   ("side", "header")]


fresh = server_with()  # a server of its own, beside the module's `server`


# ---- max_tokens beyond the context: clamped (and recorded), or a 400 when strict ----

@pytest.fixture(scope="module")
def short_context(tiny):
    """The tiny model served as if its context window held 64 tokens."""
    return dataclasses.replace(tiny, context_length=64)


def test_max_tokens_is_clamped_to_the_context(short_context, tmp_path):
    with ServerThread(make_settings(tmp_path), short_context) as s:
        c = s.client()
        msgs = [{"role": "user", "content": "hi"}]
        raw = c.chat.completions.with_raw_response.create(
            model="m", messages=msgs, max_tokens=32000, logit_bias=no_eos(s),
            extra_headers={"X-Session-Id": "clamp"})
        r = raw.parse()
        room = 64 - r.usage.prompt_tokens
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == room
        # the same budget rule on the other two APIs (they share the turn path)
        resp = s.client().responses.create(model="m", input="hi", max_output_tokens=32000)
        msg = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=32000, messages=[{"role": "user", "content": "hi"}], timeout=60)
        assert resp.status in ("completed", "incomplete") and msg.stop_reason
        too_long = [{"role": "user", "content": "word " * 200}]  # alone over the context
        with pytest.raises(openai_error(400)) as e:
            c.chat.completions.create(model="m", messages=too_long, max_tokens=5)
        assert e.value.code == "context_length_exceeded"
        end_session(s, "clamp")
        records = read_records(tmp_path) + read_records(tmp_path, "pending_turns.jsonl")
    by_api = {r["api"]: r for r in records if r.get("kind") == "turn"}
    assert set(by_api) == {"chat", "responses", "messages"}
    for record in by_api.values():
        assert record["sampling"]["max_tokens"] == 64 - len(record["prompt_ids"])
        assert record["sampling"]["max_tokens_requested"] == 32000
        assert record["sampling"]["max_tokens_clamped"] is True
    assert by_api["chat"]["sampling"]["max_tokens"] == room


def test_strict_max_tokens_keeps_the_400(short_context, tmp_path):
    with ServerThread(make_settings(tmp_path, strict_max_tokens=True), short_context) as s:
        c = s.client()
        with pytest.raises(openai_error(400)) as e:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=32000)
        assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
        ok = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)  # within the context: served as always
        assert ok.usage.completion_tokens <= 4


def openai_error(status):
    import openai
    return {400: openai.BadRequestError}[status]


# ---- reasoning output through the server ----

@pytest.mark.parametrize("parser", ["auto", "none"])
def test_reasoning_content_from_the_server(thinking_model, tmp_path, parser):
    with ServerThread(make_settings(tmp_path, reasoning_parser=parser), thinking_model) as s:
        c = s.client()
        kw = dict(model="m", messages=[{"role": "user", "content": "think"}], max_tokens=12,
                  logit_bias=no_eos(s), extra_headers={"X-Session-Id": "think"})
        full = c.chat.completions.create(seed=0, **kw)  # seeded: the same tokens every run
        chunks = list(c.chat.completions.create(stream=True, seed=1, **kw))
        end_session(s, "think")
        records = read_records(tmp_path)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    tok = thinking_model.tokenizer
    for record in records:  # the exact tokens stay whole; the text is split from them
        choice = record["choices"][0]
        decoded = tok.decode(choice["completion_ids"])  # mlx-lm's streaming detokenizer
        assert (choice["reasoning"] + choice["text"]).lstrip() == decoded.lstrip()  # drops a
        # completion's leading space
        assert (choice["text"] == "") == (parser == "auto")
    message = full.choices[0].message
    if parser == "auto":
        assert message.content == "" and message.model_extra["reasoning_content"]
        assert streamed and content == ""
    else:
        assert message.content and "reasoning_content" not in message.model_extra
        assert streamed == "" and content
