"""The session store: open sessions and their threads in memory, and each turn's next state.

`resolve` places a request in its session and thread, decides its turn type and whether a main
turn trains (X-RL-Train, `train_sessions_matching`), and links the thread's pending turn to its
next state. `complete` files the finished turn. Threads close on compaction and eviction,
sessions on the done header, an end call, the idle timeout and past `max_open_sessions`. A
completed main turn is journaled before the response's last bytes go out (`complete` returns the
future the caller awaits), so a crash loses no acknowledged turn; other lines are queued for the
records' writer thread, so the event loop never waits on the disk. It starts from a
`StoreStart` (closed sessions' numbering, the journaled turns still pending) that recovery.py
rebuilds at start-up, with the journal's one compaction (`live_journal`); the constructor reads
no file when given one.

Its records are in sessions/turn.py, the message rules in sessions/threads.py, the X-Request-Id
replay cache in sessions/replay.py. Knows nothing of HTTP, MLX, scoring or training: callers pass
parsed messages and tags, and each trainable turn goes to `on_trainable`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlproxy.lru import LRU
from rlproxy.paths import CONVERSATIONS, PENDING
from rlproxy.protocol import shown
from rlproxy.records import (JsonlWriter, TurnLines, all_written, compact_pending,
                             extending_line, load_pending, numbered_jsonl)
from rlproxy.sessions import threads as rules
from rlproxy.sessions.replay import ReplayCache
from rlproxy.sessions.threads import prefix_hashes, turn_heads
from rlproxy.sessions.turn import (
    Placement, Session, Thread, Turn, compacted_thread, find_turn, match_thread, new_thread,
    next_state, rewritten_thread, tool_threads,
)

if TYPE_CHECKING:  # the edge parses the headers (api/tags.py); the store only reads them
    from rlproxy.api.tags import TurnTags

log = logging.getLogger("rlproxy.sessions")

MAX_OPEN_THREADS = 64  # per session; beyond it the least recently active idle one is closed
KEEP_AGENTS = 64  # agents (system prompt and tools) whose last recorded turn a new thread extends
KEEP_CLOSED_IDS = 65536  # closed sessions whose numbering a reopen continues (oldest forgotten)


@dataclass
class StoreStart:
    """What a store starts from, rebuilt by recovery.py: `reopen` from conversations.jsonl
    (explicit session ids continue their turn numbering across restarts), `pending` from
    pending_turns.jsonl (turns still waiting for their next state: their threads reopen)."""

    # closed sessions: (the index their next turn gets, inferred: a chain may reopen one)
    reopen: LRU[str, tuple[int, bool]] = field(
        default_factory=lambda: LRU(max_items=KEEP_CLOSED_IDS))
    pending: list[dict] = field(default_factory=list)

    def recorded(self, record: dict) -> None:
        """One turn read back from conversations.jsonl: its session numbers on after it."""
        sid, index = record.get("session_id"), record.get("index", 0)
        if isinstance(sid, str) and isinstance(index, int):
            nxt = max(self.reopen.pop(sid, (0, False))[0], index + 1)
            self.reopen.put(sid, (nxt, False))


def live_journal(path: Path, recorded: set[str], lines: TurnLines) -> list[dict]:
    """The journal's turns still pending, in journal order, less those RECORDED since (a kill
    between a turn's record line and its tombstone leaves it in both files: the record wins);
    the journal is compacted to them (its one rewrite: start-up only), as written, and each is
    rebuilt in full by LINES (an entry may extend a line of conversations.jsonl)."""
    pending = [e for e in load_pending(path) if e["uid"] not in recorded]
    compact_pending(path, pending)
    return [full for full in map(lines.full, pending) if full is not None]


def read_start(data_dir: Path) -> StoreStart:
    """A store's start read from DATA_DIR alone, for a store built without one (tests that
    restart a bare store: tests/test_threads.py); the server reads each file once, in
    recovery.py, and passes it."""
    start, recorded = StoreStart(), set()
    lines = TurnLines(Path(data_dir) / CONVERSATIONS)
    for _, line in numbered_jsonl(lines.path, report_cut=True):
        record = lines.full(line)
        if record is not None:
            recorded.add(record.get("uid"))
            start.recorded(record)
    start.pending = live_journal(Path(data_dir) / PENDING, recorded, lines)
    return start


@dataclass
class SessionStats:
    idle_closed: int = 0  # sessions closed by the idle sweep
    evicted: int = 0  # sessions closed past `max_open_sessions`


class SessionStore:
    def __init__(self, data_dir: Path, idle_timeout_s: float, fsync: bool = True,
                 on_trainable: Callable[[dict], None] | None = None,
                 on_closed: Callable[[str], None] | None = None,
                 keep_closed: int = 200, keep_responses: int = 1024,
                 max_open_sessions: int = 4096, train_sessions_matching: str | None = None,
                 start: StoreStart | None = None, extend_turns: bool = True):
        """START: what recovery.py rebuilt from the records (the server always passes it); None
        reads it here with `read_start`, for a store built alone on DATA_DIR (tests only)."""
        self.data_dir = Path(data_dir)
        self.extend_turns = extend_turns  # lines that extend the thread's last recorded turn
        # (system prompt key, tools key) -> the last main turn recorded with them (_line)
        self._agents: LRU[tuple[str, str], tuple[Turn, Future, int]] = LRU(KEEP_AGENTS)
        self.idle_timeout_s = idle_timeout_s
        self.max_open_sessions = max_open_sessions
        self.train_pattern = re.compile(train_sessions_matching) \
            if train_sessions_matching is not None else None
        self.on_trainable = on_trainable or (lambda record: None)
        self.on_closed = on_closed or (lambda session_id: None)  # after its last turn is filed
        self.open: OrderedDict[str, Session] = OrderedDict()  # least recently active first
        self.closed: deque[Session] = deque(maxlen=keep_closed)
        self.stats = SessionStats()
        self._threads: dict[str, Thread] = {}  # open threads of open sessions, by id
        self._inferred_heads: dict[str, Thread] = {}  # header-less matching across sessions
        self.replay = ReplayCache(keep_responses)  # X-Request-Id -> the response it got
        start = read_start(self.data_dir) if start is None else start
        # closed sessions: (the index their next turn gets, inferred: a chain may reopen one)
        self._reopen = start.reopen
        self.conversations = JsonlWriter(self.data_dir / CONVERSATIONS, fsync=fsync,
                                         index=True)  # recovery.py reads it
        self.journal = JsonlWriter(self.data_dir / PENDING, fsync=fsync)
        for entry in start.pending:
            try:
                self._restore(entry)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                # kept in the journal (nothing is deleted), skipped here: the server starts
                log.warning("%s: pending turn %s cannot be restored (%s: %s); left in the file",
                            self.data_dir / PENDING, shown(entry.get("uid")), type(e).__name__, e)

    def close(self) -> None:
        self.conversations.close()
        self.journal.close()

    def health(self) -> dict:
        """What /healthz shows of the sessions."""
        return {"open": len(self.open),
                "awaiting_next_state": sum(len(s.pending()) for s in list(self.open.values()))}

    # ---- where a request goes ----

    def resolve(self, tags: TurnTags, messages: list[dict], tools: list[dict] | None = None,
                max_tokens: int | None = None, thread_hint: str | None = None) -> Placement:
        """The session and thread this request belongs to, and its turn type. A main request
        links its thread's pending turn to its next state, now that the next request is here.
        `thread_hint` names the thread a chained request (previous_response_id) continues."""
        hashes = prefix_hashes(messages)
        hinted = self._threads.get(thread_hint) if thread_hint else None
        if hinted is not None and tags.session_id not in (None, hinted.session_id):
            hinted = None  # the explicit session id wins over a chain into another session
        if tags.session_id is not None:
            session = self.open.get(tags.session_id)
            if session is None:  # new, or reopened (after a restart or a close): numbering goes on
                nxt, inferred = self._reopen.pop(tags.session_id, (0, False))
                session = self._add(Session(tags.session_id, inferred=inferred, turn_count=nxt))
            thread = hinted or match_thread(session.heads, hashes)
        elif hinted is not None:
            session, thread = self.open[hinted.session_id], hinted
        else:
            thread = match_thread(self._inferred_heads, hashes)
            session = self.open[thread.session_id] if thread else None
            if session is None:
                session = self._add(Session(f"auto-{uuid.uuid4().hex[:16]}", inferred=True))
        self._touch(session)
        turn_type, why = self._turn_type(tags, session, messages, tools, max_tokens)
        rewritten, compacted = False, None
        if thread is None and turn_type == "main" and not session.inferred:
            thread = rewritten_thread(session, messages, tools)
            rewritten = thread is not None
            if thread is None:
                compacted = compacted_thread(session, messages, tools)
                if compacted is not None:
                    self._close_thread(session, compacted, "compacted")
        opened = thread is None
        if opened:
            thread = self._open_thread(session, messages, tools)
            thread.compacts = compacted.id if compacted else None
        thread.last_active = time.time()
        if turn_type == "main":
            thread.main, thread.prompt_len = True, len(messages)
            if thread.pending is not None:
                self._link(session, thread, messages, hashes, by_prefix=not rewritten)
        return Placement(session, thread, turn_type, why, opened, tags.explicit_type,
                         self._no_train(tags, session.id) if turn_type == "main" else None)

    def _no_train(self, tags: TurnTags, session_id: str) -> str | None:
        """Why a main turn of this request does not train (None: it does). The header wins."""
        if tags.train is not None:
            return None if tags.train else "header"
        if self.train_pattern is not None and not self.train_pattern.search(session_id):
            return "train_sessions_matching"
        return None

    def _add(self, session: Session) -> Session:
        """Open a session; past `max_open_sessions` the longest idle one is closed first."""
        while len(self.open) >= self.max_open_sessions:
            oldest = next(iter(self.open))
            self._close(oldest, "evicted")
            self.stats.evicted += 1
            log.debug("session %s evicted (%d open sessions at most)", oldest,
                      self.max_open_sessions)
        self.open[session.id] = session
        return session

    def _touch(self, session: Session) -> None:
        session.last_active = time.time()
        if self.open.get(session.id) is session:
            self.open.move_to_end(session.id)

    def _turn_type(self, tags: TurnTags, session: Session, messages, tools,
                   max_tokens) -> tuple[str, str | None]:
        if tags.explicit_type:
            return tags.turn_type, "header" if tags.turn_type == "side" else None
        why = rules.side_rule(max_tokens, bool(tools), rules.system_key(messages),
                              tool_threads(session))
        return ("side", why) if why else ("main", None)

    def _open_thread(self, session: Session, messages, tools) -> Thread:
        thread = new_thread(session.id, messages, tools)
        live = [t for t in session.threads.values() if t.closed is None and t.pending is None]
        if len(live) >= MAX_OPEN_THREADS:  # title calls open one each: keep memory bounded
            self._close_thread(session, min(live, key=lambda t: t.last_active), "evicted")
        session.threads[thread.id] = thread
        self._threads[thread.id] = thread
        return thread

    def _link(self, session: Session, thread: Thread, messages: list[dict], hashes: list[str],
              by_prefix: bool = True) -> None:
        turn = thread.pending
        turn.next_state, turn.chosen_choice, turn.next_state_link = next_state(
            turn, messages, hashes, by_prefix)
        self._finish(session, thread, turn)

    # ---- turns ----

    def complete(self, place: Placement, turn: Turn, session_done: bool) -> Future:
        """A response finished: file it in its thread, journaled (main) or recorded (side).
        Sets the turn's thread and its final type. Returns the future of the turn's own line
        (its journal entry, or its record): the caller waits for it before the client is told.
        Lines of other turns this queued (a superseded or closed turn's record) were journaled
        before: a failure to write one of them is theirs, never a 507 for this one."""
        session, thread = place.session, place.thread
        turn.thread, turn.turn_type, turn.side_rule = thread.id, place.turn_type, place.side_rule
        turn.no_train = place.no_train
        if place.opened and not place.explicit and turn.turn_type == "main":
            # A call opened beside a tool-using thread that started after it (an agent's
            # concurrent title call): the aside rule can only be checked now.
            why = rules.side_rule(None, bool(turn.tools), rules.system_key(turn.messages),
                                  tool_threads(session, but=thread))
            if why:
                turn.turn_type, turn.side_rule = "side", why
                thread.main = thread.pending is not None
        if turn.turn_type != "main":
            turn.no_train = None
        session.turn_count = max(session.turn_count, turn.index + 1)
        self._touch(session)
        thread.last_active = session.last_active
        thread.turns += 1
        thread.last_turn = turn.uid
        if turn.turn_type == "side":
            own = self.conversations.write_nowait(turn.record())
            session.turns.append(turn.summary())
            if not thread.main:  # a side thread continues from its last turn only
                self._unindex(session, thread)
            if thread.closed is None:
                self._index(session, thread, turn)
        elif thread.closed is not None:  # compacted (or the session ended) while it ran
            turn.end = thread.closed
            own = self._finish(session, thread, turn)
        else:
            if thread.pending is not None:
                # Two main turns in flight at once in one thread: the earlier one's
                # conversation did not continue through this request, so it has no next state.
                thread.pending.end = "superseded"
                self._finish(session, thread, thread.pending)
            if session_done:  # its last turn: recorded at once, no journal entry needed
                turn.end = "session_done"
                own = self._finish(session, thread, turn)
            else:
                line, _ = self._line(thread, turn.record())
                own = self.journal.write_nowait({**line, "inferred": session.inferred})
                thread.pending = turn
                self._unindex(session, thread)
                self._index(session, thread, turn)
        if session_done and self.open.get(session.id) is session:  # not evicted meanwhile
            self._close(session.id, "session_done")
        return own

    def flushed(self) -> Future:
        """Done once every line queued so far is on disk."""
        return all_written(self.conversations.flushed(), self.journal.flushed())

    def next_index(self, session: Session) -> int:
        session.turn_count += 1
        return session.turn_count - 1

    def _index(self, session: Session, thread: Thread, turn: Turn) -> None:
        for h in turn_heads(turn.messages, turn.choices):
            thread.heads.add(h)
            session.heads[h] = thread
            if session.inferred:
                self._inferred_heads[h] = thread

    def _unindex(self, session: Session, thread: Thread) -> None:
        for h in thread.heads:
            if session.heads.get(h) is thread:
                del session.heads[h]
            if self._inferred_heads.get(h) is thread:
                del self._inferred_heads[h]
        thread.heads.clear()

    def _finish(self, session: Session, thread: Thread, turn: Turn) -> Future:
        """Record a turn whose next state is known (or never will be); the future of its line."""
        record = turn.record()
        line, depth = self._line(thread, record)
        written = self.conversations.write_nowait(line)
        if turn.turn_type == "main":  # the next turn of its thread (or agent) extends it
            thread.recorded = (turn, written, depth)
            self._agents.put((thread.system, thread.tools), thread.recorded)
        if thread.pending is turn:
            thread.pending = None
            # The tombstone goes out only once the record line is on disk: a crash in between
            # leaves the turn pending, and the restart records it (or finds it recorded).
            uid = turn.uid
            written.add_done_callback(lambda f: f.exception() is None and self._journal_done(uid))
        session.turns.append(turn.summary())
        if turn.trainable:
            self.on_trainable(record)
        return written

    def _line(self, thread: Thread, record: dict) -> tuple[dict, int]:
        """RECORD as its line, and the line's depth: extending the thread's last recorded main
        turn once that turn's line is on disk (records.py `extending_line`), or for a thread's
        first turn the last one recorded with the same system prompt and tools (a new session
        of the same agent shares its long head); else whole."""
        parent, at, depth = thread.recorded or self._agents.peek((thread.system, thread.tools),
                                                                 (None, None, 0))
        if not self.extend_turns or parent is None or at is None or not at.done() or at.cancelled() \
                or at.exception() is not None \
                or parent.uid == record["uid"]:
            return record, 0
        line = extending_line(record, {"uid": parent.uid, "prompt_ids": parent.prompt_ids,
                                       "messages": parent.messages, "tools": parent.tools},
                              at.result(), depth)
        return (record, 0) if line is None else (line, line["extends"]["depth"])

    def _journal_done(self, uid: str) -> None:
        try:
            self.journal.write_nowait({"kind": "done", "uid": uid})
        except RuntimeError:  # closed meanwhile (shutdown): the restart finds it recorded
            pass

    def _close_thread(self, session: Session, thread: Thread, reason: str) -> None:
        if thread.pending is not None:
            thread.pending.end = reason
            self._finish(session, thread, thread.pending)
        thread.closed = reason
        self._unindex(session, thread)
        self._threads.pop(thread.id, None)

    # ---- closing ----

    def end(self, session_id: str, reason: str) -> Future | None:
        """Close an open session (None: there is none). The future is done once its records
        are on disk: an end call answers after it."""
        return self.flushed() if self._close(session_id, reason) else None

    def _close(self, session_id: str, reason: str) -> bool:
        session = self.open.pop(session_id, None)
        if session is None:
            return False
        for thread in session.threads.values():
            if thread.closed is None:
                self._close_thread(session, thread, reason)
        session.closed = reason
        self.closed.append(session)
        self._reopen.put(session_id, (session.turn_count, session.inferred))
        self.on_closed(session_id)
        return True

    def sweep_idle(self, now: float | None = None, budget_s: float | None = None) -> list[str]:
        """Close idle sessions, longest idle first; with `budget_s`, stop once that much time
        is spent (call again for the rest). Returns the ids closed."""
        now = time.time() if now is None else now
        start, closed = time.perf_counter(), []
        while self.open:
            session = next(iter(self.open.values()))
            if now - session.last_active <= self.idle_timeout_s:
                break
            self._close(session.id, "idle_timeout")
            closed.append(session.id)
            if budget_s is not None and time.perf_counter() - start >= budget_s:
                break
        self.stats.idle_closed += len(closed)
        return closed

    def find(self, session_id: str) -> Session | None:
        return self.open.get(session_id) or next(
            (s for s in reversed(self.closed) if s.id == session_id), None)

    def find_turn(self, session_id: str, *, uid: str | None = None, index: int | None = None,
                  turn_id: str | None = None, step_index: int | None = None,
                  last: bool = False) -> str | None:
        """The uid of one turn of an open or recently closed session, or None."""
        session = self.find(session_id)
        return None if session is None else find_turn(
            session, uid=uid, index=index, turn_id=turn_id, step_index=step_index, last=last)

    # ---- idempotency (X-Request-Id) ----

    def stored_response(self, request_id: str):
        """The kept response; the future of the attempt still running; or None."""
        return self.replay.stored_response(request_id)

    def start_response(self, request_id: str) -> asyncio.Future:
        """This attempt runs: a repeat waits on the future until `finish_response`."""
        return self.replay.start_response(request_id)

    def finish_response(self, request_id: str, kept) -> None:
        """The attempt ended: keep its response, or None (it failed: a repeat runs anew)."""
        self.replay.finish_response(request_id, kept)

    # ---- restart ----

    def _restore(self, entry: dict) -> None:
        """A journaled turn still waiting for its next state: its session and thread reopen."""
        turn = Turn.from_record(entry)
        session = self.open.get(turn.session_id)
        if session is None:
            nxt, _ = self._reopen.pop(turn.session_id, (0, False))
            session = self._add(Session(turn.session_id, inferred=entry.get("inferred", False),
                                        turn_count=nxt))
        session.turn_count = max(session.turn_count, turn.index + 1)
        thread = session.threads.get(turn.thread) if turn.thread else None
        if thread is None:
            thread = new_thread(session.id, turn.messages, turn.tools, turn.thread)
            session.threads[thread.id] = thread
            self._threads[thread.id] = thread
        turn.thread = thread.id
        if thread.pending is not None:  # two pending in one thread: the later one continues
            thread.pending.end = "superseded"
            self._finish(session, thread, thread.pending)
        thread.main, thread.prompt_len, thread.pending = True, len(turn.messages), turn
        thread.turns += 1
        thread.last_turn = turn.uid
        self._unindex(session, thread)
        self._index(session, thread, turn)


async def sweep_idle_forever(store: SessionStore, slice_s: float = 0.005) -> None:
    """Close idle sessions every few seconds, in slices of at most `slice_s` of work each, so
    closing thousands at once never holds the event loop (requests run between slices)."""
    while True:
        await asyncio.sleep(min(5.0, store.idle_timeout_s / 4))
        closed = 0
        while batch := store.sweep_idle(budget_s=slice_s):
            closed += len(batch)
            for sid in batch:
                log.debug("session %s closed after %.0f s idle", sid, store.idle_timeout_s)
            await asyncio.sleep(0)
        if closed:
            log.info("closed %d session(s) idle for %.0f s", closed, store.idle_timeout_s)
