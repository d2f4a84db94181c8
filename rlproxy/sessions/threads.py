"""Which thread of a session a request continues, and the rules that tell side calls and
compactions apart: pure functions over templated messages.

A session is a set of threads. A request continues the thread whose last prompt + reply is a
prefix of its messages (compared by `prefix_hashes`); a request that continues none opens a new
thread. The rules below decide, for a request whose type no header names, whether it is a side
call, and whether a new thread is a compaction of an old one. Owns no state: the session store
(sessions/store.py) keeps the threads and applies these rules.
"""

from __future__ import annotations

import hashlib
import re

import orjson

# ---- a message's identity for "is this an exact prefix" ----


def _message_key(m: dict) -> bytes:
    """What must be equal for two messages to be "the same" across requests. Tool-call ids and
    surrounding whitespace are ignored: agents regenerate the former and strip the latter."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    calls = [(n, a if isinstance(a, dict) else _loads_or_text(a)) for n, a in calls]
    return orjson.dumps([m["role"], (m.get("content") or "").strip(), calls],
                        option=orjson.OPT_SORT_KEYS)


def _loads_or_text(a):
    try:
        return orjson.loads(a)
    except orjson.JSONDecodeError:
        return a


def prefix_hashes(messages: list[dict]) -> list[str]:
    """h[k] identifies messages[:k+1]; equal hashes mean equal prefixes."""
    out, h = [], b""
    for m in messages:
        h = hashlib.blake2b(h + _message_key(m), digest_size=16).digest()
        out.append(h.hex())
    return out


def reply_message(choice: dict) -> dict:
    return {"role": "assistant", "content": choice["text"],
            "tool_calls": [{"function": c["function"]} for c in choice["tool_calls"]]}


def turn_heads(messages: list[dict], choices: list[dict]) -> list[str]:
    """The prefix hashes a continuation of this turn starts with: one per choice (n > 1)."""
    return [prefix_hashes(messages + [reply_message(c)])[-1] for c in choices]


# ---- what a thread looks like from outside: its system prompt, tools and first request ----


def _digest(value) -> str:
    return hashlib.blake2b(orjson.dumps(value, option=orjson.OPT_SORT_KEYS),
                           digest_size=8).hexdigest()


# Claude Code opens its system prompt with a billing line whose `cc_version=2.1.197.<xyz>`
# suffix is derived from the conversation's first user message: it changes exactly when a
# compaction replaces that message, so system prompts are compared without it.
BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*\n*")


def system_key(messages: list[dict]) -> str:
    """The system prompt (empty when there is none). Developer messages are templated as
    system ones already."""
    first = messages[0] if messages else {}
    text = (first.get("content") or "") if first.get("role") == "system" else ""
    return _digest(BILLING_LINE.sub("", text).strip())


def tools_key(tools: list[dict] | None) -> str:
    return _digest(tools or [])


def first_user_key(messages: list[dict]) -> str:
    """The first user message: what a conversation and its edited copies share, and what a
    compaction replaces with a summary."""
    first = next((m for m in messages if m["role"] == "user"), {})
    return _digest((first.get("content") or "").strip())


# ---- the rules ----


def side_rule(max_tokens: int | None, has_tools: bool, system: str,
              tool_threads: list[tuple[str, bool]]) -> str | None:
    """Why a request without an explicit X-Turn-Type is a side call, or None (main).

    - "probe": `max_tokens` <= 1 (quota and liveness probes; nothing to learn from one token);
    - "aside": no tools and a system prompt unlike that of an open main thread that has tools
      (title, summary and topic calls made beside a tool-using agent's real turn).
    `tool_threads` is (system key, has main turns) of each open thread that offered tools.
    """
    if max_tokens is not None and max_tokens <= 1:
        return "probe"
    if not has_tools and any(s != system and main for s, main in tool_threads):
        return "aside"
    return None


def is_compaction(messages: list[dict], first_user: str, old_prompt_len: int,
                  old_first_user: str) -> bool:
    """A new thread compacts an old one with the same system prompt and tools (the caller checks
    those) when it is shorter than the old thread's last prompt and starts from a different
    first user message (the summary that replaced the history)."""
    return len(messages) < old_prompt_len and first_user != old_first_user


def is_rewrite(messages: list[dict], first_user: str, old_prompt_len: int,
               old_first_user: str) -> bool:
    """The same conversation with an edited history (same system prompt and tools, same first
    user message, longer than the old thread's last prompt): it still continues that thread,
    and the next state is what follows its last assistant message."""
    return len(messages) > old_prompt_len and first_user == old_first_user
