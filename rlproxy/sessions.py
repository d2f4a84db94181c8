"""Sessions and turns: which session a request belongs to, and each turn's next state.

Owns the session protocol (headers and body fallbacks), the open sessions in memory, linking a
turn to its next state (every message the session's next request adds after the turn's assistant
message), closing sessions (done header, end call, idle timeout), and handing each finished turn
to the record files and to the training queue. A turn whose response completed is journaled
before the response's last bytes go out, so a crash loses no acknowledged turn. Knows nothing of
HTTP or MLX; the server passes in parsed messages and the exact sampled ids.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from rlproxy.protocol import APIError
from rlproxy.records import (
    CONVERSATIONS, PENDING, JsonlWriter, compact_pending, load_pending, read_jsonl,
)

SESSION_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


@dataclass
class TurnTags:
    session_id: str | None = None
    turn_type: str = "main"
    session_done: bool = False
    turn_id: str | None = None
    step_index: int | None = None
    request_id: str | None = None
    opt_out: bool = False


def _flag(name: str, raw) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise APIError(400, f"{name} must be one of 1, true, yes, on (or 0, false, no, off), "
                   f"not {raw!r}", param=name)


def parse_turn_tags(headers, req) -> TurnTags:
    """Headers first, then the body fallbacks (`session_id`, `turn_type`, `session_done`)."""
    def header(*names):
        for n in names:
            if n in headers:
                return headers[n]
        return None

    tags = TurnTags()
    sid = header("X-Session-Id") or req.session_id
    if sid is not None:
        if not SESSION_ID.match(sid):
            raise APIError(400, "X-Session-Id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -",
                           param="X-Session-Id")
        tags.session_id = sid
    turn_type = header("X-Turn-Type") or req.turn_type or "main"
    if turn_type.strip().lower() not in ("main", "side"):
        raise APIError(400, f"X-Turn-Type must be 'main' or 'side', not {turn_type!r}",
                       param="X-Turn-Type")
    tags.turn_type = turn_type.strip().lower()
    done = header("X-Session-Done")
    if done is None:
        done = req.session_done
    tags.session_done = False if done is None else _flag("X-Session-Done", done)
    tags.turn_id = header("X-Turn-Id", "X-Hermes-Outer-Turn-Id")
    step = header("X-Step-Index", "X-Hermes-Step-Index")
    if step is not None:
        if not step.strip().isdigit():
            raise APIError(400, f"X-Step-Index must be a non-negative integer, not {step!r}",
                           param="X-Step-Index")
        tags.step_index = int(step)
    for name, value in (("X-Turn-Id", tags.turn_id),
                        ("X-Request-Id", header("X-Request-Id", "X-Hermes-Request-Id"))):
        if value is not None and not (0 < len(value) <= 256 and value.isprintable()):
            raise APIError(400, f"{name} must be 1-256 printable characters", param=name)
    tags.request_id = header("X-Request-Id", "X-Hermes-Request-Id")
    opt_out = header("X-RL-Opt-Out")
    tags.opt_out = False if opt_out is None else _flag("X-RL-Opt-Out", opt_out)
    return tags


# ---- matching conversations: a message's identity for "is this an exact prefix" ----

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
    end: str | None = None  # why there is no next state: session_done | ended | idle_timeout
    api: str = "chat"  # the front door it came through: chat | responses | messages
    thread: str | None = None  # the thread of its session it continues (see sessions.py)

    @property
    def trainable(self) -> bool:
        return self.turn_type == "main"

    def record(self) -> dict:
        return {"kind": "turn", **asdict(self), "trainable": self.trainable}

    def summary(self) -> dict:
        c = self.choices[self.chosen_choice]
        return {"uid": self.uid, "index": self.index, "turn_type": self.turn_type,
                "turn_id": self.turn_id, "step_index": self.step_index,
                "prompt_tokens": len(self.prompt_ids), "completion_tokens": len(c["completion_ids"]),
                "text": c["text"], "tool_calls": c["tool_calls"], "finish_reason": c["finish_reason"],
                "next_state": self.next_state, "end": self.end, "trainable": self.trainable}


@dataclass
class Session:
    id: str
    inferred: bool  # opened for a request without X-Session-Id
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    turn_count: int = 0
    pending: Turn | None = None  # the last main turn, waiting for its next state
    turns: list[dict] = field(default_factory=list)  # summaries of finished turns
    closed: str | None = None  # the reason, once closed

    def summary(self, with_turns: bool = False) -> dict:
        out = {"id": self.id, "open": self.closed is None, "closed": self.closed,
               "inferred": self.inferred, "created": self.created,
               "last_active": self.last_active, "turns": self.turn_count}
        if with_turns:
            out["turn_list"] = self.turns + ([self.pending.summary()] if self.pending else [])
        return out


class SessionStore:
    def __init__(self, data_dir: Path, idle_timeout_s: float, fsync: bool = True,
                 on_trainable: Callable[[dict], None] | None = None,
                 keep_closed: int = 200, keep_responses: int = 1024):
        self.data_dir = Path(data_dir)
        self.idle_timeout_s = idle_timeout_s
        self.on_trainable = on_trainable or (lambda record: None)
        self.open: dict[str, Session] = {}
        self.closed: deque[Session] = deque(maxlen=keep_closed)
        self._by_prefix: dict[str, tuple[Session, int]] = {}  # expected-prefix hash -> choice
        self._responses: OrderedDict[str, object] = OrderedDict()
        self._keep_responses = keep_responses
        # A kill between a turn's record line and its tombstone leaves it in both files: the
        # record wins. Explicit session ids also continue their turn numbering across restarts.
        recorded: set[str] = set()
        self._next_index: dict[str, int] = {}
        for r in read_jsonl(self.data_dir / CONVERSATIONS):
            recorded.add(r.get("uid"))
            sid = r.get("session_id")
            self._next_index[sid] = max(self._next_index.get(sid, 0), r.get("index", 0) + 1)
        self.conversations = JsonlWriter(self.data_dir / CONVERSATIONS, fsync=fsync)
        pending = [e for e in load_pending(self.data_dir / PENDING) if e["uid"] not in recorded]
        compact_pending(self.data_dir / PENDING, pending)
        self.journal = JsonlWriter(self.data_dir / PENDING, fsync=fsync)
        for entry in pending:
            self._restore(entry)

    def close(self) -> None:
        self.conversations.close()
        self.journal.close()

    # ---- which session ----

    def resolve(self, tags: TurnTags, messages: list[dict]) -> Session:
        """The session this request belongs to; links that session's pending turn (if any) to
        its next state, now that the next request is here."""
        hashes = prefix_hashes(messages)
        if tags.session_id is not None:
            session = self.open.get(tags.session_id)
            if session is None:
                session = Session(tags.session_id, inferred=False,
                                  turn_count=self._next_index.pop(tags.session_id, 0))
                self.open[session.id] = session
        else:
            session = self._match(hashes)
            if session is None:
                session = Session(f"auto-{uuid.uuid4().hex[:16]}", inferred=True)
                self.open[session.id] = session
        session.last_active = time.time()
        if tags.turn_type == "main" and session.pending is not None:
            self._link(session, messages, hashes)
        return session

    def _match(self, hashes: list[str]) -> Session | None:
        for h in reversed(hashes):  # the longest matching prefix wins
            hit = self._by_prefix.get(h)
            if hit and hit[0].closed is None and hit[0].inferred:
                return hit[0]
        return None

    def _link(self, session: Session, messages: list[dict], hashes: list[str]) -> None:
        turn = session.pending
        turn.next_state_link = "after_last_assistant"
        for i, choice in enumerate(turn.choices):
            expected = prefix_hashes(turn.messages + [reply_message(choice)])
            k = len(expected)
            if len(hashes) >= k and hashes[k - 1] == expected[-1]:
                turn.next_state, turn.chosen_choice, turn.next_state_link = messages[k:], i, "prefix"
                break
        else:  # the agent rewrote its history: take what follows its last assistant message
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            turn.next_state = messages[last + 1:]
        self._finish(session, turn)

    # ---- turns ----

    def complete(self, session: Session, turn: Turn, session_done: bool) -> None:
        """A response finished: journal it (main) or record it (side) before the client is told."""
        session.turn_count = max(session.turn_count, turn.index + 1)
        session.last_active = time.time()
        if turn.turn_type == "side":
            self.conversations.write(turn.record())
            session.turns.append(turn.summary())
        else:
            if session.pending is not None:
                # Two main turns in flight at once in one session: the earlier one's
                # conversation did not continue through this request, so it has no next state.
                session.pending.end = "superseded"
                self._finish(session, session.pending)
            self.journal.write({**turn.record(), "inferred": session.inferred})
            session.pending = turn
            self._index(session, turn)
        if session_done:
            self.end(session.id, "session_done")

    def next_index(self, session: Session) -> int:
        session.turn_count += 1
        return session.turn_count - 1

    def _index(self, session: Session, turn: Turn) -> None:
        for choice in turn.choices:
            h = prefix_hashes(turn.messages + [reply_message(choice)])[-1]
            self._by_prefix[h] = (session, 0)

    def _unindex(self, turn: Turn) -> None:
        for choice in turn.choices:
            self._by_prefix.pop(prefix_hashes(turn.messages + [reply_message(choice)])[-1], None)

    def _finish(self, session: Session, turn: Turn) -> None:
        record = turn.record()
        self.conversations.write(record)
        self.journal.write({"kind": "done", "uid": turn.uid})
        self._unindex(turn)
        session.pending = None
        session.turns.append(turn.summary())
        if turn.trainable:
            self.on_trainable(record)

    # ---- closing ----

    def end(self, session_id: str, reason: str) -> bool:
        session = self.open.pop(session_id, None)
        if session is None:
            return False
        if session.pending is not None:
            session.pending.end = reason
            self._finish(session, session.pending)
        session.closed = reason
        self.closed.append(session)
        return True

    def sweep_idle(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        idle = [s.id for s in self.open.values() if now - s.last_active > self.idle_timeout_s]
        for sid in idle:
            self.end(sid, "idle_timeout")
        return idle

    def find(self, session_id: str) -> Session | None:
        return self.open.get(session_id) or next(
            (s for s in reversed(self.closed) if s.id == session_id), None)

    def find_turn(self, session_id: str, *, uid: str | None = None, index: int | None = None,
                  turn_id: str | None = None, step_index: int | None = None,
                  last: bool = False) -> str | None:
        """The uid of one turn of an open or recently closed session, or None."""
        session = self.find(session_id)
        if session is None:
            return None
        turns = session.turns + ([session.pending.summary()] if session.pending else [])
        turns = sorted(turns, key=lambda t: t["index"])
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

    # ---- idempotency (X-Request-Id) ----

    def stored_response(self, request_id: str):
        return self._responses.get(request_id)

    def store_response(self, request_id: str, response) -> None:
        self._responses[request_id] = response
        self._responses.move_to_end(request_id)
        while len(self._responses) > self._keep_responses:
            self._responses.popitem(last=False)

    def forget_response(self, request_id: str) -> None:
        self._responses.pop(request_id, None)

    # ---- restart ----

    def _restore(self, entry: dict) -> None:
        fields = {k: v for k, v in entry.items() if k in Turn.__dataclass_fields__}
        turn = Turn(**fields)
        session = self.open.get(turn.session_id)
        if session is None:
            session = Session(turn.session_id, inferred=entry.get("inferred", False))
            self.open[session.id] = session
        session.turn_count = max(session.turn_count, turn.index + 1)
        session.pending = turn
        self._index(session, turn)
