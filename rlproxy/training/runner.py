"""The step runner: one batch of scorer -> trainer items in, optimizer steps out, and an `Outcome`.

`run` trains a batch between a journaled start and end (training/journal.py) and retries as the
journal allows, in a loop: a step whose compute raises costs each of its turns one attempt; a
several-turn step is then retried turn by turn (innocent turns train, the poison one alone fails
again), a one-turn step again until its turn is quarantined (max_step_attempts tries at most).
SYSTEMIC_TURNS different turns failing alike pause training instead, the last of them kept for
after the resume. A full disk, or a learner elsewhere that does not answer, charges no one: the
outcome says to wait (DISK_RETRY_S, or training/control.py `backoff`), and the books put the
items not trained yet back; a learner's own failure on one batch LEARNER_FAILED_TRIES times in a
row is charged like a step that raised. A failure after an update was applied is not the turns'
(retraining would apply it twice): logged, kept as the status, never retried. An id outside the
vocabulary would crash MLX rather than raise: such a turn is quarantined before any try.

A batch becomes examples (training/examples.py: one choice of a turn each, packed by session),
each checked first: too long, too big for memory (the learner says), or sampled more than
max_staleness versions ago is skipped with a `skipped` line. With `--baseline mean` an item the
scorer did not already baseline has an exponential running mean of past rewards (decay 0.9)
subtracted from its RL part; each reward enters the mean once, not per attempt. A batch with no
signal (`no_signal`: e.g. groups whose rewards were all equal, and no OPD term) takes no
optimizer step and publishes no version: its gradient is exactly 0, yet AdamW would move the
adapter on its momentum. Each of `train_epochs` steps runs forward_backward and optim_step on
the learner, in units the pacer (training/pacing.py) keeps to the duty cycle, then hands over to
the publisher (`after_step`), writes its line to training.jsonl, and saves when due. A learner
whose run went back (a restarted learner elsewhere) has this replica's lost steps trained again.

Not here: which items come next (training/books.py), publishing and the eval gate
(training/publisher.py), checkpoints (training/saving.py), the gradient math (training/learner.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlproxy.ops import metrics
from rlproxy.records import JsonlWriter, WriteFailed
from rlproxy.settings import Settings
from rlproxy.training import control, restart
from rlproxy.training.books import Books
from rlproxy.training.examples import no_signal, pack, turn_example
from rlproxy.training.items import item_choice, item_key, released_turns
from rlproxy.training.journal import SYSTEMIC_TURNS, outside_vocab, turn_length
from rlproxy.training.learner import Learner, LearnerFailed, LearnerUnavailable
from rlproxy.training.pacing import Pacer, Stopped
from rlproxy.training.status import Progress, Status, TrainerStats, TrainerStatus

log = logging.getLogger("rlproxy.trainer")


@dataclass
class Wait:
    """Why a batch waits, for how long, and what was raised (train_journaled raises it)."""

    reason: str
    delay: float
    error: Exception


@dataclass
class Outcome:
    """What a batch came to: its step lines (none: every turn skipped, quarantined or in a
    batch with no signal), whether it waits, whether turns failing alike paused training."""

    lines: list[dict] = field(default_factory=list)
    wait: Wait | None = None
    paused: bool = False
    stopped: bool = False  # the trainer stopped inside a step: it ended uncharged

    @property
    def trained(self) -> bool:
        return bool(self.lines)


class StepRunner:
    """AFTER_STEP() publishes a step (or counts it for the gate): whether it published;
    SAVE_IF_DUE() saves after a step; SUBMIT(item) offers an item to the trainer again."""

    def __init__(self, settings: Settings, learner: Learner, engine, books: Books,
                 writer: JsonlWriter, pacer: Pacer, progress: Progress, status: TrainerStatus,
                 stats: TrainerStats, after_step: Callable[[], bool],
                 save_if_due: Callable[[], None], submit: Callable[[dict], None],
                 vocab_size: int | None, data_dir: Path):
        self.t, self.settings, self.learner, self.books = settings.trainer, settings, learner, books
        self.engine = engine  # only its last swap pause, for the step's line
        self.journal, self.writer, self.pacer = books.journal, writer, pacer
        self.progress, self.status, self.stats = progress, status, stats
        self.after_step, self.save_if_due, self.submit = after_step, save_if_due, submit
        self.vocab_size = vocab_size  # token ids must be below it (None: not checked)
        self.data_dir = data_dir
        self.learner_failures = 0  # batches in a row a learner elsewhere could not take

    # ---- a batch, retried ----

    def run(self, batch: list[dict]) -> Outcome:
        """BATCH trained, retried as the module's docstring says. Never raises for a turn's
        sake, so the trainer thread lives on."""
        out, todo = Outcome(), [batch]
        while todo:
            part = self._admit(todo.pop(0))
            if not part:
                continue
            uids = [item_key(s) for s in part]
            try:
                self.journal.start(uids, sum(turn_length(s["turn"], item_choice(s))
                                             for s in part))
            except WriteFailed as e:  # nothing runs: it waits for disk space
                return self._waits(out, e)
            lines: list[dict] = []
            try:
                self.train_batch(part, lines)
            except Stopped as e:  # the process stops: the turns' attempts are not spent
                log.info("training step over turns %s ended by the stop: %s", ", ".join(uids), e)
                self.journal.stopped()
                out.lines += lines
                out.stopped = True
                return out
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:2000]
                if self.journal.open is None:  # after an update was applied: not the turns'
                    log.exception("training after the update over turns %s failed",
                                  ", ".join(uids))
                    self.books.mark_trained(uids)  # retraining would apply the update twice
                    self.stats.errors_after_update += 1
                    self.status.report(Status.FAILED_AFTER_UPDATE,
                                       f"after step {self.progress.step}: {error}")
                    out.lines += lines
                    continue
                gave_up = (isinstance(e, LearnerFailed)  # the learner fails on this batch
                           and self.learner_failures + 1 >= control.LEARNER_FAILED_TRIES)
                if isinstance(e, (WriteFailed, LearnerUnavailable)) and not gave_up:
                    self.journal.end(*self.journal.open, error, charge=False)  # not theirs
                    return self._waits(out, e)
                log.exception("training step over turns %s failed", ", ".join(uids))
                if len(part) == 1 and self.journal.systemic(uids, type(e).__name__):
                    self.journal.end(*self.journal.open, error, charge=False)
                    message = (f"training paused: {SYSTEMIC_TURNS} different turns in a row "
                               f"failed with {error}; fix the cause, then resume")
                    self.status.report(Status.PAUSED, message, pause=True)
                    log.error(message)
                    self.books.put_back(part)  # kept for after the resume
                    out.paused = True
                    continue
                self.journal.end(*self.journal.open, error)
                todo[:0] = [[s] for s in part]  # alone; a lone turn again, until quarantined
                continue
            self.journal.applied()  # no step was taken (every turn skipped)
            out.lines += lines
        self.learner_failures = 0
        self.status.clear(Status.WAITING_FOR_DISK, Status.WAITING_FOR_LEARNER)
        return out

    def _admit(self, part: list[dict]) -> list[dict]:
        """PART less quarantined turns; one with an id outside the vocabulary is quarantined
        now (MLX would segfault on it instead of raising)."""
        for s in part:
            bad = outside_vocab(s["turn"], self.vocab_size, item_choice(s))
            if bad is not None:
                self.books.quarantine(item_key(s), f"token id {bad} is outside this model's "
                                      f"vocabulary of {self.vocab_size} (recorded under another "
                                      "model?); training on it would crash")
        return [s for s in part if item_key(s) not in self.journal.quarantined]

    def _waits(self, out: Outcome, e: Exception) -> Outcome:
        if isinstance(e, LearnerUnavailable):
            self.learner_failures += 1
            delay = control.backoff(self.learner_failures)
            reason = (f"training waits for the learner (try {self.learner_failures}, next in "
                      f"{delay:g} s): {e}")
            self.status.report(Status.WAITING_FOR_LEARNER, reason)
        else:
            self.learner_failures = 0
            delay, reason = control.DISK_RETRY_S, f"training waits for disk space: {e}"
            self.status.report(Status.WAITING_FOR_DISK, reason)
        log.error(reason)
        out.wait = Wait(reason, delay, e)
        return out

    # ---- one batch ----

    def train_batch(self, batch: list[dict], out: list[dict] | None = None) -> list[dict]:
        """Its step lines, appended to OUT as they are written (what a caller keeps on a raise)."""
        out = [] if out is None else out
        examples = [e for e in (self.example(s) for s in batch) if e is not None]
        if not examples:
            return out
        examples = pack(examples)  # a session's turns in one pass, when exact
        uids = [u for e in examples for u in e["uids"]]
        reason = no_signal(examples, self.t)
        if reason is not None:
            self._skip_batch(examples, uids, reason)
            return out
        if self.learner.off_policy == "decoupled" and self.t.train_epochs > 1:
            self.learner.proximal(examples, self.pacer.unit)  # the clip's anchor, every epoch
        for epoch in range(self.t.train_epochs):
            out.append(self.train_step(examples, epoch))
            if epoch == 0:  # trained now, whatever a later epoch does
                self.books.mark_trained(uids)
                self.stats.turns_trained += len(uids)
        return out

    def example(self, scored: dict) -> dict | None:
        """The item as a training example, or None (recorded as skipped, with the reason)."""
        key, p = item_key(scored), self.progress
        ex = turn_example(scored["turn"], scored["advantages"], scored["reward"],
                          choice=item_choice(scored), key=key, version=p.version)
        reason = self._skip_reason(ex)
        if reason is not None:
            if self.books.skip(key):
                self.stats.skipped += 1
                self.writer.write({"kind": "skipped", "uid": key, "reason": reason})
                log.warning("skipped turn %s: %s", key, reason)
            return None
        if (self.t.baseline == "mean" and scored["reward"] is not None
                and not scored.get("baselined")):
            # An exponential running mean of past rewards (decay 0.9), subtracted from the RL
            # part only: it follows the policy as it improves, where an all-time mean lags.
            if p.baseline_n:
                lo = ex["mask"].index(1.0)
                ex["adv"][lo:] = [a - self.settings.scoring.w_rl * p.baseline
                                  for a in ex["adv"][lo:]]
            if self.books.in_baseline(key):
                p.baseline = (0.9 * p.baseline + 0.1 * scored["reward"] if p.baseline_n
                              else scored["reward"])
                p.baseline_n += 1
        return ex

    def _skip_reason(self, ex: dict | None) -> str | None:
        if ex is None:
            return "no completion tokens"
        if len(ex["ids"]) > self.t.max_context_tokens:
            return f"{len(ex['ids'])} tokens > max_context_tokens {self.t.max_context_tokens}"
        late, limit = ex["staleness"][0], self.t.max_staleness
        if limit is not None and late is not None and late > limit:
            return (f"sampled {late} adapter versions before v{self.progress.version} > "
                    f"max_staleness {limit}")
        return self.learner.too_big(ex)

    def _skip_batch(self, examples: list[dict], uids: list[str], reason: str) -> None:
        """One `skipped` line for a batch that takes no step; its turns count as handled (the
        line's uids are read back as trained at start-up), so they are not retried."""
        self.books.mark_trained(uids)
        self.stats.skipped += len(uids)
        self.stats.skipped_steps += 1
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        self.writer.write({
            "kind": "skipped", "uids": uids, "reason": reason, "step": self.progress.step,
            "adapter_version": self.progress.version, "turns": len(uids),
            "tokens": sum(e["tokens"] for e in examples),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "time": round(time.time(), 3)})
        log.info("skipped a batch of %d turns: %s", len(uids), reason)

    def train_step(self, examples: list[dict], epoch: int = 0) -> dict:
        """One optimizer step over EXAMPLES on the learner, handed to the publisher; its line."""
        tic, p = time.perf_counter(), self.progress
        self.pacer.restart()
        fb = self.learner.forward_backward(examples, between=self.pacer.unit)
        unit = time.perf_counter()
        log.info("forward_backward step=%d loss=%.4f tokens=%d", p.step + 1, fb.loss, fb.tokens)
        opt = self.learner.optim_step(self.learner.learning_rate())
        self.journal.applied()
        if back := self.learner.went_back():  # a restarted learner elsewhere
            self.train_again(*back)
        self.pacer(time.perf_counter() - unit)
        p.step += 1
        # a shared remote run numbers versions by its own steps, every replica's
        p.version = max(p.version + 1, opt.run_step or 0)
        pause = self.engine.stats.last_swap_ms if self.engine is not None else None
        published = self.after_step()
        log.info("optim_step step=%d version=%d lr=%.3g", p.step, p.version, opt.learning_rate)
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        units = self.pacer.units
        line = {
            "kind": "step", "step": p.step, "adapter_version": p.version, "epoch": epoch,
            "loss": fb.loss, "kl": fb.kl / fb.tokens, "entropy": fb.entropy / fb.tokens,
            "loss_fn": self.t.loss_fn, "off_policy": self.learner.off_policy,
            "reward_mean": mean,
            "reward_std": (math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                           if rewards else None),
            "turns": sum(len(e["uids"]) for e in examples), "sequences": len(examples),
            "tokens": fb.tokens, "grad_norm": opt.grad_norm,
            "step_time_s": round(time.perf_counter() - tic, 4),
            "previous_swap_pause_ms": pause,  # the engine applies this step's swap later
            "learning_rate": opt.learning_rate, "lr_scale": self.learner.lr_scale,
            "published": published, "uids": [u for e in examples for u in e["uids"]],
            "staleness": [s for e in examples for s in e["staleness"]],  # per uid
            **opt.line,  # a remote run's step
            **({"shard_tokens": fb.shard_tokens} if fb.shard_tokens else {}),  # mlx.launch
            "prompt_grad": self.t.prompt_grad, "units": units["units"],
            "max_unit_s": round(units["max_unit_s"], 4),
            "yielded_s": round(units["yielded_s"], 4), "time": round(time.time(), 3),
        }
        self.writer.write(line)
        metrics.observe_train_step(line)
        self.stats.steps, self.stats.last_loss = p.step, fb.loss
        self.stats.learning_rate = opt.learning_rate
        self.stats.optimizer_steps += 1
        self.save_if_due()
        return line

    def train_again(self, saved: int, last: int) -> None:
        """The learner's run went back to its step SAVED (a restarted learner) after this
        replica had seen step LAST: the turns of this replica's steps SAVED+1 .. LAST train
        again."""
        lost = restart.lost_run_steps(restart.read_training(self.data_dir), saved, last)
        if not lost:
            return
        self.books.retrain(lost)
        s = self.settings.scoring
        items = [x for x in released_turns(self.data_dir, s.w_opd, s.w_rl,
                                           skip=self.books.trained,
                                           max_attempts=self.t.max_step_attempts)
                 if item_key(x) in lost]
        self.writer.write({"kind": "train_again", "reason": f"the learner's run went back from "
                           f"step {last} to {saved} (a restart from its last saved state)",
                           "turns_again": sorted(lost), "step": self.progress.step,
                           "time": round(time.time(), 3)})
        log.warning("the learner's run went back from step %d to %d: %d turns of this "
                    "replica's lost steps train again", last, saved, len(items))
        for item in items:
            self.submit(item)
