"""The trainer's books: which scorer -> trainer items (training/items.py, keyed by `item_key`) wait,
which are being gathered into a batch, and which are handled, with one method per change of an
item's state.

  offer        a released item joins the inbox, once (`queued` holds its key until it is
               handled); an update for a waiting one replaces it (`latest`); past MAX_QUEUED
               waiting, an item is left for a restart to offer again (released_turns)
  next_batch   the next `size` items from the inbox; one whose earlier step failed comes back
               alone, at once; a suspect (in a step an unproven process died in:
               training/journal.py) waits until this process is proven, then comes back alone
  settle       after a batch: its handled items leave `queued`, an updated one goes round
               again; with `again` (the batch waits for disk or a learner) the others go back
               to the inbox
  mark_trained, skip, quarantine, retrain
               the ways an item is handled (`trained`, `skipped`, the journal's `quarantined`),
               and back to not handled (steps a restart lost)
  in_baseline  whether an item's reward is new to the running mean (once per item)

`trained` holds every key until `trim` bounds it to TRAINED_KEEP (start-up resubmits what
needed the whole history first). Everything changes under one lock: offers come from the
scorer's thread, the rest from the trainer's. This is not journal.py's `Books` (what the journal
file says), which the `journal` here keeps.

Not here: threads, training, the journal's file (training/journal.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from enum import Enum
from typing import Callable, Iterable

from rlproxy.lru import LRU
from rlproxy.training.items import item_key
from rlproxy.training.journal import StepJournal

log = logging.getLogger("rlproxy.trainer")
TRAINED_KEEP = 100_000  # keys remembered as trained once running (start-up reads them all)
MAX_QUEUED = 10_000  # items waiting; past it an item waits for a restart (released_turns)
SUSPECT_LOOK_S = 1.0  # with suspects waiting: look again this often whether it is proven


class Offered(Enum):
    QUEUED = "queued"  # new: in the inbox now
    KNOWN = "known"  # trained, waiting (an update replaced it) or quarantined
    DROPPED = "dropped"  # MAX_QUEUED wait already: a restart offers it again


class Books:
    def __init__(self, journal: StepJournal, trained: LRU):
        self.journal = journal  # its `quarantined`, and what it knows of failed tries
        self.inbox: queue.Queue = queue.Queue()  # items; None wakes next_batch
        self.queued: set[str] = set()  # offered, not yet trained, skipped or quarantined
        self.latest: dict[str, dict] = {}  # key -> a feedback update that came while queued
        self.trained = trained  # trained, or skipped in a batch with no signal
        self.skipped = LRU(TRAINED_KEEP)  # skipped in this process: one line each
        self.taken = LRU(TRAINED_KEEP)  # keys whose rewards the running mean has taken
        self.gathering: list[dict] = []  # items collected towards the next batch
        self.suspects: list[dict] = []  # items waiting for this process to be proven
        self.dropped = 0  # items refused past MAX_QUEUED
        self.closed = False
        self.lock = threading.Lock()

    # ---- in ----

    def offer(self, item: dict) -> Offered:
        """A released item, from any thread."""
        key = item_key(item)
        if key in self.journal.quarantined:  # never again, whatever feedback says
            return Offered.KNOWN
        with self.lock:
            if item.get("update"):  # feedback changed its reward: train on it again
                self.trained.discard(key)
                self.skipped.discard(key)
                if key in self.queued:  # waiting, or in a step now: the newest copy replaces it
                    self.latest[key] = item
                    return Offered.KNOWN
            if key in self.trained or key in self.queued:
                return Offered.KNOWN
            if len(self.queued) >= MAX_QUEUED:  # training far behind: a restart offers it again
                self.dropped += 1
                if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                    log.warning("the trainer has %d items waiting; %d released items were left "
                                "for a restart to train", MAX_QUEUED, self.dropped)
                return Offered.DROPPED
            self.queued.add(key)
            self.inbox.put(item)
        return Offered.QUEUED

    def wake(self) -> None:
        """next_batch returns [] now, once (an operator's request waits for the trainer)."""
        self.inbox.put(None)

    def close(self) -> None:
        """Stopping: next_batch returns [] from now on."""
        self.closed = True
        self.inbox.put(None)

    # ---- out ----

    def next_batch(self, size: int,
                   idle: Callable[[], float | None] = lambda: None) -> list[dict]:
        """The next SIZE items, or one alone (see the module's docstring); [] when woken.
        IDLE() is called while none is ready: the seconds until it wants calling again (None:
        never)."""
        while not self.closed:
            if self.suspects and self.journal.proven:
                return [self.suspects.pop(0)]
            wait = SUSPECT_LOOK_S if self.suspects else None  # CLEAN_RUN_S may have passed
            due = idle()
            if due is not None:
                wait = due if wait is None else min(wait, due)
            try:
                item = self.inbox.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                break
            key = item_key(item)
            with self.lock:
                item = self.latest.pop(key, item)  # an update came meanwhile
            if self.journal.suspect(key) and not self.journal.proven:
                self.suspects.append(item)
                continue
            if self.journal.tries(key):
                return [item]
            self.gathering.append(item)
            if len(self.gathering) == size:
                batch, self.gathering = self.gathering, []
                with self.lock:
                    return [self.latest.pop(item_key(s), s) for s in batch]
        return []

    def settle(self, batch: list[dict], again: bool = False) -> None:
        """After BATCH's step: its items leave `queued` once handled; one whose reward changed
        meanwhile goes round again with the new reward. AGAIN (the batch waits for disk space or
        a learner): its items not handled go back to the inbox as they are (one trained before,
        in a turn-by-turn retry, must not get a second update)."""
        done: list[dict] = []
        left: list[dict] = []
        with self.lock:
            for s in batch:
                (left if again and not self._handled(item_key(s)) else done).append(s)
            for key in {item_key(s) for s in done}:
                if key in self.latest:
                    self.inbox.put(self.latest.pop(key))
                elif self._handled(key):
                    self.queued.discard(key)
        self.put_back(left)

    def put_back(self, items: Iterable[dict]) -> None:
        """ITEMS wait again, still queued (to be tried after a wait, or after a resume)."""
        for item in items:
            self.inbox.put(item)

    # ---- handled, or not ----

    def _handled(self, key: str) -> bool:
        return key in self.trained or key in self.skipped or key in self.journal.quarantined

    def mark_trained(self, keys: Iterable[str]) -> None:
        with self.lock:
            for key in keys:
                self.trained.add(key)

    def skip(self, key: str) -> bool:
        """KEY is skipped (too long, too big, too stale); whether it is the first time in this
        process (retried at each restart: one line each)."""
        with self.lock:
            first = key not in self.skipped
            self.skipped.add(key)
        return first

    def quarantine(self, key: str, reason: str) -> None:
        """Never train KEY again (the journal writes why)."""
        self.journal.quarantine(key, reason)

    def retrain(self, keys: Iterable[str]) -> None:
        """KEYS were trained in steps a restart lost: they may train again."""
        with self.lock:
            for key in keys:
                self.trained.discard(key)

    def in_baseline(self, key: str) -> bool:
        """Whether KEY's reward is new to the running mean, which takes it now: once per item,
        not per attempt (a learner outage's retries are not charged)."""
        with self.lock:
            new = not self.journal.tries(key) and key not in self.taken
            if new:
                self.taken.add(key)
        return new

    def trim(self) -> None:
        with self.lock:
            self.trained.trim(TRAINED_KEEP)
