"""The scoring worker: turns with a next state in, scored turns out to the trainer.

Consumes finished main turns (from the session store's queue, or replayed from the records at
start-up), asks the judge for votes (rl), for a hint and the teacher's log-probs (opd), or both
(combine), applies explicit feedback and reward functions, and writes one `score` line per turn
to prm_scores.jsonl. A scored turn is *released* to training (a `release` line, then
`on_released`) at once, unless at-least-one may still lift it: then turns with reward <= 0 wait
until their session's last turn is scored. Durable by construction: a turn is unscored until its
`score` line exists, so after a crash or a judge outage it is simply scored again, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlproxy import metrics, scoring
from rlproxy.judges import JudgeUnavailable
from rlproxy.records import CONVERSATIONS, JsonlWriter, read_jsonl
from rlproxy.settings import ScoringSettings

log = logging.getLogger("rlproxy.scorer")
SCORES = "prm_scores.jsonl"


@dataclass
class Tally:
    """One session's scoring state while some of its turns wait for at-least-one."""

    held: dict[str, dict] = field(default_factory=dict)  # uid -> score line, not released
    rewards: dict[str, tuple[int, float]] = field(default_factory=dict)  # uid -> (index, r)
    pending: int = 0  # turns queued, in flight or waiting out an outage
    closed: bool = False  # its last turn has been scored


def load_reward_functions(names: list[str]) -> list[Callable]:
    out = []
    for name in names:
        module, func = name.split(":")
        try:
            out.append(getattr(importlib.import_module(module), func))
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be loaded: {e}") from None
    return out


class Scorer:
    def __init__(self, settings: ScoringSettings, data_dir: Path, judge, teacher, tokenizer,
                 fsync: bool = True, on_released: Callable[[dict], None] | None = None):
        self.s, self.judge, self.teacher, self.tokenizer = settings, judge, teacher, tokenizer
        self.prompts = scoring.load_prompts(settings.prm_prompts)
        self.functions = load_reward_functions(settings.reward_functions)
        self.data_dir = Path(data_dir)
        self.on_released = on_released or (lambda scored: None)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.scored: set[str] = set()
        self.known: set[str] = set()  # uids queued, in flight, waiting or scored
        self.feedback: dict[str, tuple[float, str | None]] = {}
        self.released: dict[str, dict] = {}  # uid -> latest release line
        self.lines: dict[str, dict] = {}  # uid -> score line (for feedback after scoring)
        self.turns: dict[str, dict] = {}  # uid -> turn record, until released
        self.recent: OrderedDict[str, dict] = OrderedDict()  # released, for later feedback
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.waiting: list[dict] = []  # deferred by a judge outage
        self.stats = {"scored": 0, "released": 0, "waiting": 0, "outages": 0}
        self.semaphore = asyncio.Semaphore(settings.judge_concurrency)
        self._replay()
        self.writer = JsonlWriter(self.data_dir / SCORES, fsync=fsync)

    # ---- input ----

    def submit(self, record: dict) -> None:
        """A finished trainable turn (called on the event loop)."""
        if record["uid"] in self.known:
            return
        self.known.add(record["uid"])
        self.tallies[record["session_id"]].pending += 1
        self.queue.put_nowait(record)

    def _replay(self) -> None:
        for line in read_jsonl(self.data_dir / SCORES):
            uid = line.get("uid")
            if line.get("kind") == "score":
                self.scored.add(uid)
                self.known.add(uid)
                self.lines[uid] = line
                tally = self.tallies[line["session_id"]]
                if line["reward"] is not None:
                    tally.rewards[uid] = (line["index"], line["reward"])
                tally.closed |= line["final"]
                tally.held[uid] = line
            elif line.get("kind") == "release":
                self.released[uid] = line
            elif line.get("kind") == "feedback":
                self.feedback[uid] = (line["reward"], line.get("comment"))
        for tally in self.tallies.values():
            tally.held = {u: ln for u, ln in tally.held.items() if u not in self.released}
        for record in read_jsonl(self.data_dir / CONVERSATIONS):
            if record.get("trainable") and record["uid"] not in self.known:
                self.submit(record)
            elif record.get("uid") in self.tallies.get(record.get("session_id"), Tally()).held:
                self.turns[record["uid"]] = record

    @property
    def pending(self) -> int:
        """Turns submitted and not scored yet: queued, being judged, or waiting out an outage."""
        return len(self.known) - len(self.scored)

    # ---- the loop ----

    async def run(self) -> None:
        """Score forever; also finishes sessions restored from the records."""
        for sid in list(self.tallies):
            self._maybe_close(sid)
        retry = asyncio.create_task(self._retry_waiting())
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                record = await self.queue.get()
                task = asyncio.create_task(self._score_safely(record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            retry.cancel()
            for t in tasks:
                t.cancel()

    async def _retry_waiting(self) -> None:
        delay = 1.0
        while True:
            await asyncio.sleep(delay)
            if self.waiting:
                batch, self.waiting = self.waiting, []
                for record in batch:
                    self.queue.put_nowait(record)
                delay = min(delay * 2, 30.0)
            else:
                delay = 1.0
            self.stats["waiting"] = len(self.waiting)

    async def _score_safely(self, record: dict) -> None:
        try:
            await self.score(record)
        except JudgeUnavailable as e:
            self.stats["outages"] += 1
            log.warning("judge unavailable for turn %s (%s); it will be retried", record["uid"], e)
            self.waiting.append(record)
        except Exception:
            log.exception("scoring turn %s failed; it will be retried", record["uid"])
            self.waiting.append(record)
        self.stats["waiting"] = len(self.waiting)

    async def _limited(self, make_call):
        async with self.semaphore:  # the call is made only once a slot is free
            return await make_call()

    def _seed(self, uid: str, i: int) -> int:
        return int(hashlib.blake2b(f"{uid}:{i}".encode(), digest_size=4).hexdigest(), 16)

    async def _ask(self, kind: str, record: dict) -> list[dict]:
        """m answers to one prompt; all failing to reach the judge is an outage."""
        text = scoring.fill_prompt(self.prompts[kind], record, self.s.prm_max_context_chars)
        messages = [{"role": "user", "content": text}]
        answers = await asyncio.gather(*[
            self._limited(lambda i=i: self.judge.complete(
                messages, self.s.prm_temperature, self.s.prm_max_tokens,
                self._seed(record["uid"], i)))
            for i in range(self.s.prm_m)], return_exceptions=True)
        if all(isinstance(a, Exception) for a in answers):
            raise JudgeUnavailable(str(answers[0]))
        return [{"text": a, "error": None} if isinstance(a, str)
                else {"text": None, "error": f"{type(a).__name__}: {a}"} for a in answers]

    async def score(self, record: dict) -> None:
        uid, started = record["uid"], time.time()
        if uid in self.scored:
            return
        choice = record["choices"][record.get("chosen_choice", 0)]
        has_next = record["next_state"] is not None
        votes, judge_reward, hint, teacher_lp = [], None, None, None
        if self.s.method in ("rl", "combine") and has_next and self.s.judge:
            votes = await self._ask("judge", record)
            for v in votes:
                v["vote"] = scoring.parse_vote(v["text"]) if v["text"] is not None else None
            judge_reward = scoring.majority([v["vote"] for v in votes])
        if self.s.method in ("opd", "combine") and has_next:
            hints = await self._ask("hint", record)
            hint = scoring.best_hint([h["text"] for h in hints if h["text"]])
            if hint:
                teacher_msgs = scoring.hinted_messages(record["messages"], hint)
                prompt_ids = self.tokenizer.apply_chat_template(
                    teacher_msgs, tools=record["tools"], add_generation_prompt=True)
                teacher_lp = await self._limited(lambda: self.teacher.teacher_logprobs(
                    list(prompt_ids), choice["completion_ids"]))
        function_reward = self._function_reward(record)
        feedback = self.feedback.get(uid)
        reward = None
        if self.s.method in ("rl", "combine"):
            reward = scoring.final_reward(judge_reward, function_reward,
                                          feedback[0] if feedback else None, self.s.feedback_mode)
        if uid in self.scored:  # scored meanwhile (a duplicate that slipped past): keep one
            return
        line = {
            "kind": "score", "uid": uid, "session_id": record["session_id"],
            "index": record["index"], "method": self.s.method,
            "votes": [{"vote": v.get("vote"), "text": v["text"], "error": v["error"]}
                      for v in votes],
            "judge_reward": judge_reward, "function_reward": function_reward,
            "feedback": feedback[0] if feedback else None, "reward": reward,
            "hint": hint, "teacher_logprobs": teacher_lp,
            "teacher": None if teacher_lp is None else {
                "tokens": len(teacher_lp),
                "mean_teacher_lp": sum(teacher_lp) / max(1, len(teacher_lp)),
                "mean_behaviour_lp": sum(choice["logprobs"]) / max(1, len(choice["logprobs"]))},
            "judge_latency_s": round(time.time() - started, 3),
            "final": record["end"] is not None,
        }
        self.writer.write(line)
        metrics.observe_score(line)
        self.scored.add(uid)
        self.lines[uid], self.turns[uid] = line, record
        self.stats["scored"] += 1
        log.info("scored session=%s turn=%s votes=%s reward=%s%s", record["session_id"],
                 record["index"], [v.get("vote") for v in votes], _fmt(reward),
                 f" hint={hint!r}" if hint else "",
                 extra={"session_id": record["session_id"], "turn_uid": uid})
        tally = self.tallies[record["session_id"]]
        tally.pending -= 1
        tally.closed |= line["final"]
        if reward is not None:
            tally.rewards[uid] = (record["index"], reward)
        if not self.s.at_least_one or reward is None or reward > 0 or self.s.method == "opd":
            self._release(line, reward, "scored")
        else:
            tally.held[uid] = line
        self._maybe_close(record["session_id"])

    def _function_reward(self, record: dict) -> float | None:
        for fn in self.functions:
            try:
                value = fn(record, record["next_state"])
            except Exception:
                log.exception("reward function %s failed on turn %s", fn.__name__, record["uid"])
                continue
            if value is not None:
                return max(-1.0, min(1.0, float(value)))
        return None

    # ---- release ----

    def _maybe_close(self, session_id: str) -> None:
        tally = self.tallies.get(session_id)
        if tally is None or not tally.closed or tally.pending > 0:
            return
        lift = scoring.at_least_one(tally.rewards) if self.s.at_least_one else None
        for uid, line in list(tally.held.items()):
            if uid == lift:
                self._release(line, 1.0, "at_least_one")
            else:
                self._release(line, line["reward"], "session_closed")
        del self.tallies[session_id]

    def _release(self, line: dict, reward: float | None, reason: str) -> None:
        uid = line["uid"]
        record = self.turns.pop(uid, None) or self.recent.get(uid)
        if record is not None:
            self.recent[uid] = record
            while len(self.recent) > 4096:
                self.recent.popitem(last=False)
        release = {"kind": "release", "uid": uid, "session_id": line["session_id"],
                   "index": line["index"], "reward": reward, "reason": reason}
        self.writer.write(release)
        self.released[uid] = release
        self.stats["released"] += 1
        if reason == "feedback" and reward is not None:  # a reward scoring never saw
            metrics.REWARD.observe(reward)
        if reason == "at_least_one":
            log.info("at_least_one session=%s turn=%s reward=+1", line["session_id"],
                     line["index"])
        if record is None:
            return  # restored from disk without its turn: the trainer reads it from the records
        choice = record["choices"][record.get("chosen_choice", 0)]
        advantages = scoring.token_advantages(choice["logprobs"], line["teacher_logprobs"],
                                              reward, self.s.w_opd, self.s.w_rl)
        if advantages is not None:
            self.on_released({"turn": record, "reward": reward, "advantages": advantages,
                              "teacher_logprobs": line["teacher_logprobs"],
                              "update": reason == "feedback"})

    # ---- explicit feedback ----

    def add_feedback(self, uid: str, session_id: str, reward: float, comment: str | None) -> str:
        """Record feedback; returns what happened to it: pending | applied | rescored."""
        self.writer.write({"kind": "feedback", "uid": uid, "session_id": session_id,
                           "reward": reward, "comment": comment, "at": time.time()})
        self.feedback[uid] = (reward, comment)
        line = self.lines.get(uid)
        if line is None:
            return "pending"  # applied when the turn is scored
        new = scoring.final_reward(line["judge_reward"], line["function_reward"], reward,
                                   self.s.feedback_mode)
        line["feedback"], line["reward"] = reward, new
        tally = self.tallies.get(session_id)
        if tally is not None and uid in tally.held:
            tally.rewards[uid] = (line["index"], new)
            if new > 0:
                del tally.held[uid]
                self._release(line, new, "feedback")
            return "applied"
        self._release(line, new, "feedback")
        return "rescored"


def _fmt(r):
    return "none" if r is None else (int(r) if float(r).is_integer() else round(r, 3))
