"""What the session store keeps: turns, the threads they belong to, sessions, and where one
request goes (`Placement`), with the pure functions that read them.

A `Turn` is one served response as it is filed (`record()` is its line in conversations.jsonl);
a `Thread` is one line of conversation in a session; a `Session` holds its threads and the
summaries of its finished turns. The functions below find a turn's next state and threads in a
session (by prefix hash, by agent, rewritten or compacted); they change nothing. Closing, linking
and filing are the store's (sessions/store.py); the message rules are in sessions/threads.py.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

from rlproxy.sessions import threads as rules


@dataclass
class Turn:
    uid: str
    session_id: str
    index: int
    turn_type: str
    requested_model: str
    messages: list[dict]  # the prompt messages, as templated
    tools: list[dict] | None
    prompt_ids: list[int]  # exactly as templated for sampling
    choices: list[dict]  # completion_ids, logprobs, adapter_versions, text, tool_calls, ...
    sampling: dict
    timings: dict
    turn_id: str | None = None
    step_index: int | None = None
    request_id: str | None = None
    next_state: list[dict] | None = None
    next_state_link: str | None = None  # "prefix" | "after_last_assistant"
    chosen_choice: int = 0  # which choice the conversation continued from (n > 1)
    end: str | None = None  # why no next state: session_done | ended | idle_timeout |
    # superseded | compacted | evicted
    api: str = "chat"  # the front door it came through: chat | responses | messages
    thread: str | None = None  # the thread of its session it belongs to (set by complete())
    side_rule: str | None = None  # why it is a side turn: header | probe | aside (sessions/threads.py)
    no_train: str | None = None  # why a main turn does not train: header (X-RL-Train: 0) |
    # train_sessions_matching (its session id does not match) | write_failed (the client got 507)

    @property
    def trainable(self) -> bool:
        return self.turn_type == "main" and self.no_train is None

    @classmethod
    def from_record(cls, record: dict) -> Turn:
        """The turn a journal line holds (its extra keys, such as `kind`, are dropped)."""
        return cls(**{k: v for k, v in record.items() if k in cls.__dataclass_fields__})

    def record(self) -> dict:
        # Shallow (asdict deep-copies 15k-token id lists): nothing changes a filed turn's lists.
        return {"kind": "turn", **{f.name: getattr(self, f.name) for f in fields(self)},
                "trainable": self.trainable}

    def summary(self) -> dict:
        c = self.choices[self.chosen_choice]
        return {"uid": self.uid, "index": self.index, "turn_type": self.turn_type,
                "side_rule": self.side_rule, "thread": self.thread, "api": self.api,
                "turn_id": self.turn_id, "step_index": self.step_index,
                "prompt_tokens": len(self.prompt_ids), "completion_tokens": len(c["completion_ids"]),
                "text": c["text"], "tool_calls": c["tool_calls"], "finish_reason": c["finish_reason"],
                "next_state": self.next_state, "end": self.end, "trainable": self.trainable}


@dataclass
class Thread:
    """One line of conversation in a session: each of its requests continues its last turn."""

    id: str
    session_id: str
    system: str  # threads.system_key of its first request
    tools: str  # threads.tools_key
    has_tools: bool
    first_user: str  # threads.first_user_key
    prompt_len: int = 0  # messages in its latest main request
    main: bool = False  # a main request went into it
    turns: int = 0
    last_turn: str | None = None  # uid
    last_active: float = field(default_factory=time.time)
    pending: Turn | None = None  # its last main turn, waiting for its next state
    heads: set[str] = field(default_factory=set)  # prefix hashes that continue it
    closed: str | None = None  # compacted | evicted | the session's closing reason
    compacts: str | None = None  # the thread whose history its first request summarized
    # its last main turn recorded in conversations.jsonl, the future of that line (its byte
    # offset once on disk) and how many lines it is from a whole one: the next turn's lines
    # extend it (records.py `extending_line`)
    recorded: tuple[Turn, Future, int] | None = None

    def summary(self) -> dict:
        return {"id": self.id, "open": self.closed is None, "closed": self.closed,
                "main": self.main, "tools": self.has_tools, "turns": self.turns,
                "last_turn": self.last_turn, "pending": self.pending.uid if self.pending else None,
                "compacts": self.compacts}


def new_thread(session_id: str, messages: list[dict], tools: list[dict] | None,
               thread_id: str | None = None) -> Thread:
    """A thread whose first request has these messages and tools (a fresh id unless given)."""
    return Thread(thread_id or f"th-{uuid.uuid4().hex[:12]}", session_id,
                  rules.system_key(messages), rules.tools_key(tools), bool(tools),
                  rules.first_user_key(messages))


@dataclass
class Session:
    id: str
    inferred: bool  # opened for a request without X-Session-Id
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    turn_count: int = 0
    threads: dict[str, Thread] = field(default_factory=dict)
    heads: dict[str, Thread] = field(default_factory=dict)  # prefix hash -> thread it continues
    turns: list[dict] = field(default_factory=list)  # summaries of finished turns
    closed: str | None = None  # the reason, once closed

    def pending(self) -> list[Turn]:
        return [t.pending for t in self.threads.values() if t.pending is not None]

    def summary(self, with_turns: bool = False) -> dict:
        out = {"id": self.id, "open": self.closed is None, "closed": self.closed,
               "inferred": self.inferred, "created": self.created,
               "last_active": self.last_active, "turns": self.turn_count,
               "threads_open": sum(t.closed is None for t in self.threads.values())}
        if with_turns:
            out["threads"] = [t.summary() for t in self.threads.values()]
            out["turn_list"] = sorted(self.turns + [t.summary() for t in self.pending()],
                                      key=lambda t: t["index"])
        return out


@dataclass
class Placement:
    """Where one request goes: its session, its thread, and its turn type (with the reason)."""

    session: Session
    thread: Thread
    turn_type: str
    side_rule: str | None
    opened: bool  # this request opened the thread
    explicit: bool  # the type came from X-Turn-Type: no rule may change it
    no_train: str | None = None  # a main turn here does not train, and why (Turn.no_train)


def next_state(turn: Turn, messages: list[dict], hashes: list[str],
               by_prefix: bool = True) -> tuple[list[dict], int, str]:
    """What the next request of its thread adds after this turn's reply: (next state, the choice
    it continued from, how it was linked: "prefix" | "after_last_assistant")."""
    k = len(turn.messages) + 1
    for i, choice in enumerate(turn.choices if by_prefix else []):
        if len(hashes) >= k and hashes[k - 1] == rules.turn_heads(turn.messages, [choice])[0]:
            return messages[k:], i, "prefix"
    # the agent rewrote its history: take what follows its last assistant message
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[last + 1:], turn.chosen_choice, "after_last_assistant"


# ---- finding threads ----


def match_thread(heads: dict[str, Thread], hashes: list[str]) -> Thread | None:
    """The open thread the longest prefix of a request (its `prefix_hashes`) continues."""
    for h in reversed(hashes):  # the longest matching prefix wins
        thread = heads.get(h)
        if thread is not None and thread.closed is None:
            return thread
    return None


def tool_threads(session: Session, but: Thread | None = None) -> list[tuple[str, bool]]:
    """(system key, has main turns) of each open thread that offered tools: what
    threads.side_rule compares a request with."""
    return [(t.system, t.main) for t in session.threads.values()
            if t.closed is None and t.has_tools and t is not but]


def same_agent(session: Session, messages: list[dict], tools) -> list[Thread]:
    """Open main threads with this request's system prompt and tools, latest first."""
    system, tkey = rules.system_key(messages), rules.tools_key(tools)
    same = [t for t in session.threads.values()
            if t.closed is None and t.main and t.system == system and t.tools == tkey]
    return sorted(same, key=lambda t: t.last_active, reverse=True)


def rewritten_thread(session: Session, messages: list[dict], tools) -> Thread | None:
    """The pending thread this request continues with an edited history, if any."""
    first = rules.first_user_key(messages)
    return next((t for t in same_agent(session, messages, tools) if t.pending
                 and rules.is_rewrite(messages, first, t.prompt_len, t.first_user)), None)


def compacted_thread(session: Session, messages: list[dict], tools) -> Thread | None:
    """The thread whose history this request summarizes, if any (the store closes it)."""
    first = rules.first_user_key(messages)
    return next((t for t in same_agent(session, messages, tools)
                 if rules.is_compaction(messages, first, t.prompt_len, t.first_user)), None)


def find_turn(session: Session, *, uid: str | None = None, index: int | None = None,
              turn_id: str | None = None, step_index: int | None = None,
              last: bool = False) -> str | None:
    """The uid of one of this session's turns (the last main one with `last`), or None."""
    turns = session.summary(with_turns=True)["turn_list"]
    if last:
        main = [t for t in turns if t["turn_type"] == "main"]
        return main[-1]["uid"] if main else None
    for t in turns:
        if ((uid is not None and t["uid"] == uid)
                or (index is not None and t["index"] == index)
                or (turn_id is not None and t["turn_id"] == turn_id
                    and (step_index is None or t["step_index"] == step_index))):
            return t["uid"]
    return None
