"""The trainer's books (training/books.py) on their own: a real step journal in a temporary data
dir, items shaped as the scorer hands them, no model and no thread but the ones a test starts.
Each transition of an item (offered, gathered into a batch, settled, trained, skipped,
quarantined, trained again) is checked by what the books then hold and give out."""

from __future__ import annotations

import threading

import pytest

from rlproxy.lru import LRU
from rlproxy.training import books as books_module
from rlproxy.training.books import Books, Offered
from rlproxy.training.journal import StepJournal


def item(uid: str, reward: float = 1.0, **extra) -> dict:
    turn = {"uid": uid, "prompt_ids": [1, 2], "choices": [{"completion_ids": [3, 4]}]}
    return {"turn": turn, "reward": reward, "advantages": [reward] * 2, **extra}


def uids(batch: list[dict]) -> list[str]:
    return [s["turn"]["uid"] for s in batch]


@pytest.fixture
def journal(tmp_path):
    j = StepJournal(tmp_path, fsync=False)
    yield j
    j.close()


@pytest.fixture
def books(journal):
    return Books(journal, LRU())


def prove(journal: StepJournal) -> None:
    """One clean step: the process is proven (training/journal.py's crash blame)."""
    n = journal.start(["clean"], 4)
    journal.end(n, ["clean"])


def test_an_item_is_queued_once_and_batches_come_in_the_order_offered(books):
    assert [books.offer(item(u)) for u in "abca"] == [Offered.QUEUED] * 3 + [Offered.KNOWN]
    assert books.queued == {"a", "b", "c"} and books.inbox.qsize() == 3
    assert uids(books.next_batch(2)) == ["a", "b"]
    books.wake()  # c is gathered, then the wake-up ends the wait: no batch yet
    assert books.next_batch(2) == [] and uids(books.gathering) == ["c"]
    assert books.queued == {"a", "b", "c"}  # handed out is not handled


def test_settle_lets_handled_items_go_and_keeps_the_others(books):
    for u in "abc":
        books.offer(item(u))
    batch = books.next_batch(3)
    books.mark_trained(["a"])
    books.skip("b")
    books.settle(batch)
    assert books.queued == {"c"}  # c was neither trained, skipped nor quarantined
    assert books.offer(item("a")) is Offered.KNOWN  # trained: not again
    assert books.offer(item("b")) is Offered.QUEUED  # skipped only: a restart offers it again


def test_a_batch_that_waits_puts_back_only_what_was_not_handled(books):
    for u in "ab":
        books.offer(item(u))
    batch = books.next_batch(2)
    books.mark_trained(["a"])  # trained in a turn-by-turn retry before the disk filled
    books.settle(batch, again=True)
    assert books.queued == {"b"}
    assert uids([books.inbox.get_nowait()]) == ["b"] and books.inbox.empty()


def test_an_update_replaces_a_waiting_copy_and_retrains_a_trained_one(books):
    books.offer(item("a", 1.0))
    assert books.offer(item("a", 0.25, update=True)) is Offered.KNOWN  # waiting: replaced
    books.offer(item("b"))
    batch = books.next_batch(2)
    assert [(s["turn"]["uid"], s["reward"]) for s in batch] == [("a", 0.25), ("b", 1.0)]
    # an update that comes while a's step runs goes round again when the step settles
    books.offer(item("a", -1.0, update=True))
    books.mark_trained(["a", "b"])
    books.settle(batch)
    assert books.queued == {"a"}
    assert [s["reward"] for s in [books.inbox.get_nowait()]] == [-1.0]
    books.mark_trained(["a"])
    books.settle([item("a", -1.0)])
    assert books.queued == set()
    assert books.offer(item("a", 0.5, update=True)) is Offered.QUEUED  # trained: again


def test_a_quarantined_item_is_refused_and_counts_as_handled(books, journal):
    books.offer(item("q"))
    batch = books.next_batch(1)
    books.quarantine("q", "three failed attempts")
    assert "q" in journal.quarantined
    books.settle(batch)
    assert books.queued == set()
    assert books.offer(item("q")) is Offered.KNOWN
    assert books.offer(item("q", update=True)) is Offered.KNOWN  # whatever feedback says


def test_an_item_that_failed_before_comes_back_alone_at_once(books, journal):
    n = journal.start(["r"], 4)
    journal.end(n, ["r"], "ValueError: boom")  # one charged attempt of two
    for u in "ar":
        books.offer(item(u))
    assert uids(books.next_batch(4)) == ["r"]  # though a is gathering for a batch of 4
    assert uids(books.gathering) == ["a"]


def test_a_suspect_waits_until_the_process_is_proven_then_comes_back_alone(tmp_path):
    died = StepJournal(tmp_path, fsync=False)
    died.start(["s"], 4)  # ... and the process died in its first step: unproven
    died.close()
    journal = StepJournal(tmp_path, fsync=False)
    try:
        assert journal.suspect("s") and not journal.proven
        books = Books(journal, LRU())
        for u in "sab":
            books.offer(item(u))
        assert uids(books.next_batch(2)) == ["a", "b"]  # the suspect is held back
        assert uids(books.suspects) == ["s"]
        prove(journal)
        assert uids(books.next_batch(2)) == ["s"]
    finally:
        journal.close()


def test_next_batch_asks_idle_while_waiting_and_close_ends_it(books):
    calls = []

    def idle():
        calls.append(1)
        if len(calls) == 3:
            books.offer(item("late"))
        return 0.01

    assert uids(books.next_batch(1, idle)) == ["late"]
    assert len(calls) >= 3  # called each time the wait ran out
    books.close()
    books.offer(item("after"))
    assert books.next_batch(1) == []  # closed: nothing more, not even what waits


def test_the_queue_has_a_cap_and_trained_keys_are_trimmed(books, monkeypatch):
    monkeypatch.setattr(books_module, "MAX_QUEUED", 2)
    monkeypatch.setattr(books_module, "TRAINED_KEEP", 3)
    assert [books.offer(item(u)) for u in "abcd"] == [Offered.QUEUED] * 2 + [Offered.DROPPED] * 2
    assert books.dropped == 2 and books.queued == {"a", "b"}
    books.mark_trained(["k1", "k2", "k3", "k4", "k5"])
    books.trim()
    assert list(books.trained) == ["k3", "k4", "k5"]


def test_retrain_forgets_trained_keys_and_skip_says_the_first_time(books):
    books.mark_trained(["a", "b"])
    books.retrain(["a"])
    assert set(books.trained) == {"b"}
    assert books.offer(item("a")) is Offered.QUEUED
    assert [books.skip("x"), books.skip("x")] == [True, False]


def test_the_running_mean_takes_each_reward_once_and_none_of_a_retried_item(books, journal):
    assert [books.in_baseline("a"), books.in_baseline("a")] == [True, False]
    n = journal.start(["r"], 4)
    journal.end(n, ["r"], "LearnerUnavailable: down", charge=False)
    journal.end(journal.start(["r"], 4), ["r"], "ValueError: boom")
    assert journal.tries("r") and not books.in_baseline("r")


def test_offers_from_many_threads_queue_each_item_once(books):
    keys = [f"k{i}" for i in range(200)]
    threads = [threading.Thread(target=lambda: [books.offer(item(k)) for k in keys])
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert books.queued == set(keys) and books.inbox.qsize() == len(keys)
    batch = books.next_batch(len(keys))
    assert sorted(uids(batch)) == sorted(keys)
    books.mark_trained(keys)
    books.settle(batch)
    assert books.queued == set()
