"""The scoring worker: turns with a next state in, scored choices out to the trainer.

Consumes finished main turns (from the session store, or found unscored at start-up),
asks the judge for votes (rl), for a hint and the teacher's log-probs (opd), or both (combine),
applies explicit feedback and reward functions, and writes one `score` line per turn to
prm_scores.jsonl. When the turn's request asked for n > 1, every choice is scored against the
same next state by the reward functions, and by the judge and teacher with --score-all-choices.
When the ledger (scoring/ledger.py: at-least-one) releases a turn, each of its choices with
something to train gets a `release` line and goes to `on_released` (the trainer's submit), with
a group baseline when 2 or more of its choices have a reward (scoring/judging.py). Durable by
construction: a turn is unscored until its `score` line is on disk, so after a crash or a judge
outage it is simply scored again, once.

Runs on the event loop and never blocks it: record lines go through the writer thread, reward
functions and the teacher's chat template run on worker threads. Only `known` and `pending` are
read from other threads. Bounded: a turn's state is kept while its session is open; after that
only the last KEEP_RECENT released turns (for feedback that re-trains them) and KEEP_SCORED small
summaries (for feedback that re-releases them) are. Counters: `ScorerStats`; `health()` is what
/healthz shows under "scoring". Reads no file: it starts from a `ScorerStart`, rebuilt from the
records at start-up by recovery.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from rlproxy import paths
from rlproxy.lru import LRU
from rlproxy.ops import metrics
from rlproxy.records import JsonlWriter, WriteFailed
from rlproxy.scoring import judging as scoring
from rlproxy.scoring import notes
from rlproxy.scoring.judge_health import JudgeHealth
from rlproxy.scoring.judges import JudgeUnavailable
from rlproxy.scoring.ledger import Ledger, Release
from rlproxy.scoring.rewards import RewardFunctions
from rlproxy.serving.chat_template import render_prompt
from rlproxy.settings import ScoringSettings

log = logging.getLogger("rlproxy.scorer")
KEEP_RECENT = 4096  # released turns kept whole for feedback that trains them again (README)
RECENT_MB = 256.0  # ... and at most this much of them (a 15k-token turn packs to ~100 KB)
KEEP_SCORED = 65536  # summaries of scored turns, for feedback that only re-releases them
KEEP_FEEDBACK = 4096  # feedback for turns not scored yet


@dataclass
class ScorerStats:
    scored: int = 0  # turns with a score line on disk
    released: int = 0  # release lines written (one per choice)
    waiting: int = 0  # turns waiting out a judge outage
    outages: int = 0  # turns deferred because no judge answered
    function_errors: int = 0  # reward function calls that failed


def pack(record: dict) -> bytes:
    # A turn as JSON bytes: ~5x smaller than its lists of Python ints.
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS)


def summary(line: dict) -> dict:
    """A score line without vote texts and teacher log-probs: enough to re-release it."""
    keep = ("uid", "session_id", "index", "chosen_choice", "judge_reward", "function_reward",
            "feedback", "reward")
    out = {k: line[k] for k in keep}
    out["other_choices"] = [{k: o[k] for k in ("choice", "judge_reward", "function_reward",
                                               "reward")} for o in line.get("other_choices", [])]
    return out


@dataclass
class ScorerStart:
    """What a scorer starts from, rebuilt by recovery.py from prm_scores.jsonl (the ledger, the
    judge's counts, summaries, feedback for turns not scored yet) and conversations.jsonl (held
    and recent turns, packed; trainable turns without a score line, scored again). `fresh`
    makes one for an empty history, with the scorer's bounds."""

    ledger: Ledger
    recent: LRU[str, tuple[dict, bytes]]  # released turns: uid -> (score line, packed turn)
    summaries: LRU[str, dict]  # uid -> summary(score line)
    feedback: LRU[str, tuple[float, str | None]] = field(
        default_factory=lambda: LRU(KEEP_FEEDBACK))  # for turns not scored yet
    judge_health: JudgeHealth = field(default_factory=JudgeHealth)
    held: dict[str, tuple[dict, bytes | None]] = field(default_factory=dict)
    unscored: list[dict] = field(default_factory=list)  # trainable turns with no score line

    @classmethod
    def fresh(cls, settings: ScoringSettings, keep_recent: int = KEEP_RECENT,
              recent_mb: float = RECENT_MB, keep_scored: int = KEEP_SCORED) -> ScorerStart:
        # at-least-one lifts judge verdicts: OPD has none
        ledger = Ledger(at_least_one=settings.at_least_one and settings.method != "opd",
                        keep_done=keep_scored)
        return cls(ledger, LRU(keep_recent, int(recent_mb * 2**20)), LRU(keep_scored))


class Scorer:
    def __init__(self, settings: ScoringSettings, data_dir: Path, judge, teacher, tokenizer,
                 start: ScorerStart, fsync: bool = True,
                 on_released: Callable[[dict], None] | None = None, baseline: str = "mean",
                 judge_name: str = "default"):
        """START: what recovery.py rebuilt from the records; the constructor reads no file."""
        self.s, self.judge, self.teacher, self.tokenizer = settings, judge, teacher, tokenizer
        # log-prob verdicts until a judge without log-probs makes it fall back to votes
        self.verdict_mode = settings.prm_verdict
        self.judge_name = judge_name  # its calibration's key in verdict.json
        self.baseline = baseline  # settings.trainer.baseline: group | group-std | mean | none
        self.prompts = scoring.load_prompts(settings.prm_prompts)
        self.calibration = self._calibration(judge_name)
        self.rewards = RewardFunctions(settings.reward_functions, settings.reward_timeout_s)
        self.data_dir = Path(data_dir)
        self.on_released = on_released or (lambda scored: None)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ledger = start.ledger
        self._lock = threading.Lock()  # the ledger is read from other threads (`known`)
        self.held = start.held  # uid -> (score line, packed turn)
        self.recent = start.recent  # released turns, bounded in count and bytes
        self.summaries = start.summaries
        self.feedback = start.feedback  # not scored yet
        self.waiting: list[dict] = []  # deferred by a judge outage
        self.stats = ScorerStats()
        self.judge_health = start.judge_health
        self.semaphore = asyncio.Semaphore(settings.judge_concurrency)
        for record in start.unscored:  # submitted to the ledger by recovery.py
            self.queue.put_nowait(record)
        self.writer = JsonlWriter(self.data_dir / paths.SCORES, fsync=fsync)

    def close(self) -> None:
        """Write what is queued and close the file (not on the event loop: it waits)."""
        self.writer.close()

    def health(self) -> dict:
        """What /healthz shows under "scoring"."""
        return {**asdict(self.stats), "pending": self.pending, "method": self.s.method,
                "verdict": self.verdict_mode if self.s.judge else None,
                "judge": self.judge_health.summary()}

    def _calibration(self, name: str) -> dict | None:
        """verdict.json's calibration for the judge model NAME (None: the raw odds)."""
        calibration = self.prompts["verdict_json"]["calibration"].get(name)
        if calibration is None and self.s.judge and self.s.prm_verdict == "logprob" and (
                self.s.method != "opd"):
            log.warning("no calibration for judge %r in %s: log-prob verdicts use the raw odds "
                        "of the two labels (fit one: bench/judge_accuracy.py --calibrate "
                        "--judge-name %s)", name, Path(self.s.prm_prompts) / "verdict.json", name)
        return calibration

    # ---- what it knows (thread-safe) ----

    @property
    def pending(self) -> int:
        """Turns submitted and not scored yet: queued, being judged, or waiting out an outage."""
        return self.ledger.pending

    @property
    def known(self) -> set[str]:
        """Uids of turns submitted to scoring (those of sessions finished long ago forgotten)."""
        with self._lock:
            return self.ledger.known_uids()

    # ---- input ----

    def submit(self, record: dict) -> None:
        """A finished trainable turn (called on the event loop)."""
        with self._lock:
            fresh = self.ledger.submit(record["uid"], record["session_id"])
        if fresh:
            self.queue.put_nowait(record)

    # ---- the loop ----

    async def run(self) -> None:
        """Score forever; first finishes sessions restored from the records."""
        with self._lock:
            releases = self.ledger.settle()
        for release in releases:
            self._release(release)
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
            self.stats.waiting = len(self.waiting)

    async def _score_safely(self, record: dict) -> None:
        try:
            await self.score(record)
        except JudgeUnavailable as e:
            self.stats.outages += 1
            log.warning("judge unavailable for turn %s (%s); it will be retried", record["uid"], e)
            self.waiting.append(record)
        except WriteFailed as e:  # a full disk: /healthz names the file; no traceback
            log.warning("scoring turn %s not written (%s); it will be retried", record["uid"], e)
            self.waiting.append(record)
        except Exception:
            log.exception("scoring turn %s failed; it will be retried", record["uid"])
            self.waiting.append(record)
        self.stats.waiting = len(self.waiting)

    async def _limited(self, make_call):
        async with self.semaphore:  # the call is made only once a slot is free
            return await make_call()

    def _seed(self, key: str, i: int) -> int:
        return int(hashlib.blake2b(f"{key}:{i}".encode(), digest_size=4).hexdigest(), 16)

    async def _ask(self, kind: str, record: dict, choice: int) -> list[dict]:
        """m answers to one prompt about one choice; all failing to reach the judge is an
        outage."""
        text = scoring.fill_prompt(self.prompts[f"{kind}_txt"], record,
                                   self.s.prm_max_context_chars, choice)
        messages = [{"role": "user", "content": text}]
        key = scoring.choice_key(record["uid"], choice, record.get("chosen_choice", 0))
        answers = await asyncio.gather(*[
            self._limited(lambda i=i: self.judge.complete(
                messages, self.s.prm_temperature, self.s.prm_max_tokens, self._seed(key, i)))
            for i in range(self.s.prm_m)], return_exceptions=True)
        if all(isinstance(a, Exception) for a in answers):
            raise JudgeUnavailable(str(answers[0]))
        return [{"text": a, "error": None} if isinstance(a, str)
                else {"text": None, "error": f"{type(a).__name__}: {a}"} for a in answers]

    async def _votes(self, record: dict, choice: int) -> list[dict]:
        votes = await self._ask("judge", record, choice)
        for v in votes:
            v["vote"] = scoring.parse_vote(v["text"]) if v["text"] is not None else None
        return votes

    async def _verdict(self, record: dict, choice: int) -> dict | None:
        """One log-prob verdict on one choice (scoring/judging.py reads it); None when the judge
        gives no log-probs."""
        text = scoring.fill_verdict_prompt(self.prompts["verdict_txt"], record,
                                           self.s.prm_max_context_chars, choice)
        labels = self.prompts["verdict_json"]["labels"]
        top = await self._limited(lambda: self.judge.verdict(text, list(labels)))
        if top is None:
            return None
        return scoring.read_verdict(top, labels, self.calibration, self.s.prm_min_margin)

    def _fall_back_to_votes(self) -> None:
        if self.verdict_mode != "votes":
            self.verdict_mode = "votes"
            log.warning("the judge (%s) returns no log-probs: PRM verdicts fall back to votes "
                        "(--prm-m %d answers of judge.txt)", self.judge_name, self.s.prm_m)

    def _teacher_prompt(self, record: dict, hint: str) -> list[int]:
        """On a worker thread: a long prompt's chat template takes a while."""
        messages = scoring.hinted_messages(record["messages"], hint)
        return render_prompt(self.tokenizer, messages, record["tools"])

    async def score(self, record: dict) -> None:
        uid, started = record["uid"], time.time()
        if not self.ledger.is_pending(uid):
            return
        chosen, n = record.get("chosen_choice", 0), len(record["choices"])
        everyone = list(range(n))
        judged = everyone if self.s.score_all_choices else [chosen]
        # an empty next state tells the judge nothing, nor one of the agent's own notes only
        has_next = bool(notes.without_notes(record["next_state"] or []))
        cut = {i: notes.cut(record, i, self.s.judge_cut_turns) for i in everyone}
        rl, opd = self.s.method in ("rl", "combine"), self.s.method in ("opd", "combine")
        votes, verdicts, judge, teacher, hint = {}, {}, {}, {}, None
        functions, errors = {}, []
        if rl and self.rewards:
            functions, errors = await self.rewards.score(record, everyone)
        pending_feedback = self.feedback.peek(uid)
        # under override a choice whose reward feedback or a function decides is not judged:
        # the judge's answer could not count
        skipped = [i for i in judged if self.s.feedback_mode == "override" and (
            functions.get(i) is not None or (pending_feedback is not None and i == chosen))]
        asked = [i for i in judged if i not in skipped and cut[i] is None]
        if rl and has_next and self.s.judge and asked:
            if self.verdict_mode == "logprob":
                got = await asyncio.gather(*[self._verdict(record, i) for i in asked])
                if any(v is None for v in got):  # the judge gives no log-probs
                    self._fall_back_to_votes()
                else:
                    verdicts = dict(zip(asked, got))
                    judge = {i: v["reward"] for i, v in verdicts.items()}
            if self.verdict_mode == "votes":
                got = await asyncio.gather(*[self._votes(record, i) for i in asked])
                votes = dict(zip(asked, got))
                # no valid vote, a tie or a majority of 0: undecided (no judge reward)
                judge = {i: scoring.majority([v["vote"] for v in vs]) or None
                         for i, vs in votes.items()}
        if opd and has_next:
            hints = await self._ask("hint", record, chosen)
            hint = scoring.best_hint([h["text"] for h in hints if h["text"]])
            if hint:  # the same hindsight for every choice: they share the prompt
                prompt_ids = await asyncio.to_thread(self._teacher_prompt, record, hint)
                lps = await asyncio.gather(*[self._limited(
                    lambda i=i: self.teacher.teacher_logprobs(
                        prompt_ids, record["choices"][i]["completion_ids"])) for i in judged])
                teacher = dict(zip(judged, lps))
        feedback = self.feedback.pop(uid, None)

        def reward(i):  # feedback is about the reply the conversation went on from
            fb = feedback[0] if feedback and i == chosen else None
            return (scoring.final_reward(judge.get(i), functions.get(i), fb,
                                         self.s.feedback_mode) if rl else None)

        def figures(i):
            return {"votes": [{"vote": v.get("vote"), "text": v["text"], "error": v["error"]}
                              for v in votes.get(i, [])],
                    "verdict": verdicts.get(i), "judge_reward": judge.get(i),
                    "function_reward": functions.get(i),
                    "reward": reward(i), "teacher_logprobs": teacher.get(i),
                    "cut": cut[i]}  # why the judge was not asked: length | agent_note (notes.py)

        lp, behaviour = teacher.get(chosen), record["choices"][chosen]["logprobs"]
        line = {
            "kind": "score", "uid": uid, "session_id": record["session_id"],
            "index": record["index"], "method": self.s.method, "chosen_choice": chosen,
            **figures(chosen), "feedback": feedback[0] if feedback else None, "hint": hint,
            "teacher": None if lp is None else {
                "tokens": len(lp), "mean_teacher_lp": sum(lp) / max(1, len(lp)),
                "mean_behaviour_lp": sum(behaviour) / max(1, len(behaviour))},
            "function_errors": errors,
            "judged": chosen in votes or chosen in verdicts,
            "judge_skipped": bool(rl and has_next and self.s.judge and chosen in skipped),
            "judge_latency_s": round(time.time() - started, 3),
            "final": record["end"] is not None,
        }
        if n > 1:
            line["other_choices"] = [{"choice": i, **figures(i)} for i in everyone if i != chosen]
        packed = pack(record)
        try:
            await self.writer.write_async(line)  # scored once this is on disk
        except Exception:
            if feedback:
                self.feedback.assign(uid, feedback)  # applied when the turn is scored again
            raise
        self.held[uid] = (line, packed)
        self.summaries.put(uid, summary(line))
        with self._lock:
            releases = self.ledger.score(uid, record["index"], line["reward"], line["final"],
                                         liftable(line))
        self.judge_health.count(line)
        metrics.observe_score(line)
        self.stats.scored += 1
        self.stats.function_errors += len(errors)
        for e in errors:
            log.warning("reward function %s failed on turn %s choice %d: %s", e["function"],
                        uid, e["choice"], e["error"])
        log.info("scored session=%s turn=%s votes=%s reward=%s%s", record["session_id"],
                 record["index"], [v.get("vote") for v in votes.get(chosen, [])],
                 _fmt(line["reward"]), f" hint={hint!r}" if hint else "",
                 extra={"session_id": record["session_id"], "turn_uid": uid})
        for release in releases:
            self._release(release, record if release.uid == uid else None)
        late = self.feedback.pop(uid, None)  # arrived while the score line was being written
        if late is not None:
            self._apply_feedback(uid, line, late[0])

    def session_closed(self, session_id: str) -> None:
        """The session store closed SESSION_ID (on the event loop): release what it held."""
        with self._lock:
            releases = self.ledger.close(session_id)
        for release in releases:
            self._release(release)

    # ---- release ----

    def _release(self, release: Release, record: dict | None = None) -> None:
        """Write a released turn's release lines and hand its choices to the trainer (RECORD:
        the turn, when at hand; else it is unpacked)."""
        uid, feedback = release.uid, release.reason == "feedback"
        line, packed = self.held.pop(uid, None) or self.recent.peek(uid) or (
            self.summaries.peek(uid), None)
        if line is None:
            return
        n = 1 + len(line.get("other_choices", []))
        lines = scoring.release_lines(line, n, release.reward, release.reason, self.baseline,
                                      with_others=not feedback,
                                      std_floor=self.s.group_std_floor)
        for out in lines:
            self.writer.write_nowait(out).add_done_callback(_log_failure)
        self.stats.released += len(lines)
        if feedback and release.reward is not None:  # a reward scoring never saw
            metrics.REWARD.observe(release.reward)
        if release.reason != "feedback":
            self.judge_health.released += 1
        if release.reason == "at_least_one":
            self.judge_health.lifted += 1
            log.info("at_least_one session=%s turn=%s reward=+1", line["session_id"],
                     line["index"])
        if packed is None:
            return  # its turn is not in memory: `rlproxy train --from` reads it from the records
        self.recent.put(uid, (line, packed), len(packed))  # for feedback that trains it again
        record = record or orjson.loads(packed)
        for out in lines:
            item = scoring.released_item(record, line, out, self.s.w_opd, self.s.w_rl,
                                         update=feedback)
            if item is None:
                continue
            try:
                self.on_released(item)
            except Exception:  # the release line is written: `rlproxy train --from` has it
                log.exception("handing turn %s choice %d to the trainer failed", uid,
                              item["choice"])

    # ---- explicit feedback ----

    async def add_feedback(self, uid: str, session_id: str, reward: float,
                           comment: str | None) -> str:
        """Record feedback (on disk before this returns); what happened to it: pending (applied
        when the turn is scored) | applied (the turn was held) | rescored (released again)."""
        await self.writer.write_async({"kind": "feedback", "uid": uid, "session_id": session_id,
                                       "reward": reward, "comment": comment, "at": time.time()})
        entry = self.held.get(uid) or self.recent.peek(uid)
        line = entry[0] if entry else self.summaries.peek(uid)
        if line is None or self.ledger.is_pending(uid):
            self.feedback.assign(uid, (reward, comment))
            return "pending"
        return self._apply_feedback(uid, line, reward)

    def _apply_feedback(self, uid: str, line: dict, reward: float) -> str:
        """Feedback on a scored turn: its new reward goes to the ledger (held: released with it;
        released: released again), and a `rescore` line says it beside the score line, which
        keeps what scoring said (recovery reads the feedback line, not this one)."""
        self.judge_health.compare(line.get("judge_reward"), reward)
        was = line["reward"]
        new = scoring.final_reward(line["judge_reward"], line["function_reward"], reward,
                                   self.s.feedback_mode)
        for same in (line, self.summaries.peek(uid)):
            if same is not None:
                same["feedback"], same["reward"] = reward, new
        with self._lock:
            status, releases = self.ledger.feedback(uid, new)
        if status == "unknown":  # scored long ago and forgotten by the ledger: release again
            status, releases = "rescored", [Release(uid, new, "feedback")]
        self.writer.write_nowait({
            "kind": "rescore", "uid": uid, "session_id": line["session_id"],
            "index": line["index"], "reward": new, "was": was, "feedback": reward,
            "status": status, "at": time.time()}).add_done_callback(_log_failure)
        for release in releases:
            self._release(release)
        return status


def liftable(line: dict) -> bool:
    """May at-least-one lift this turn? Only when its reward is the judge's decided verdict
    alone: never over a person's feedback or a reward function's score."""
    return (line.get("feedback") is None and line.get("function_reward") is None
            and line.get("judge_reward") is not None)


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.error("a release or rescore line could not be written: %s", future.exception())


def _fmt(r):
    return "none" if r is None else (int(r) if float(r).is_integer() else round(r, 3))
