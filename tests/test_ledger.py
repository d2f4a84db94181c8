"""The at-least-one ledger (rlproxy/scoring/ledger.py) on hand-built event sequences: submit, score,
feedback, restore -> releases. Pure: no server, no files."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlproxy.scoring.ledger import Ledger, Release


def run(ledger: Ledger, session: str, rewards: list[float | None], final: bool = True,
        start: int = 0) -> list[Release]:
    """Submit a session's turns, then score them in order; the last one ends it if FINAL."""
    uids = [f"{session}-{start + i}" for i in range(len(rewards))]
    for uid in uids:
        assert ledger.submit(uid, session)
    out = []
    for i, (uid, r) in enumerate(zip(uids, rewards)):
        out += ledger.score(uid, start + i, r, final and i == len(rewards) - 1)
    return out


def test_positive_and_unrewarded_turns_go_at_once_others_wait_for_the_close():
    led = Ledger()
    for uid in ("a0", "a1", "a2", "a3"):
        led.submit(uid, "a")
    assert led.score("a0", 0, 1.0, False) == [Release("a0", 1.0, "scored")]
    assert led.score("a1", 1, -1.0, False) == []
    assert led.score("a2", 2, None, False) == [Release("a2", None, "scored")]
    assert led.is_held("a1") and led.pending == 1
    # the last turn: a positive turn exists, so the held one goes with its own reward
    assert led.score("a3", 3, 0.0, True) == [Release("a1", -1.0, "session_closed"),
                                             Release("a3", 0.0, "session_closed")]
    assert led.tallies == {} and led.session_of == {} and led.pending == 0


def test_a_negative_session_lifts_its_best_turn_the_latest_among_equals():
    out = run(Ledger(), "neg", [-1.0, 0.0, -1.0, 0.0, -0.5])
    assert out == [Release("neg-0", -1.0, "session_closed"),
                   Release("neg-1", 0.0, "session_closed"),
                   Release("neg-2", -1.0, "session_closed"),
                   Release("neg-3", 1.0, "at_least_one"),
                   Release("neg-4", -0.5, "session_closed")]


def test_unrewarded_turns_are_never_lifted():
    assert run(Ledger(), "none", [None, None]) == [Release("none-0", None, "scored"),
                                                   Release("none-1", None, "scored")]
    out = run(Ledger(), "mix", [None, -1.0, None])
    assert Release("mix-1", 1.0, "at_least_one") in out


def test_off_releases_every_turn_when_scored():
    out = run(Ledger(at_least_one=False), "off", [-1.0, 0.0])
    assert out == [Release("off-0", -1.0, "scored"), Release("off-1", 0.0, "scored")]


def test_the_close_waits_for_turns_still_pending():
    led = Ledger()
    for uid in ("s0", "s1"):
        led.submit(uid, "s")
    # the last turn (no next state, no judge) is scored before an earlier one's judge answers
    assert led.score("s1", 1, -1.0, True) == []
    assert led.pending == 1 and "s" in led.tallies
    assert led.score("s0", 0, -1.0, False) == [Release("s0", -1.0, "session_closed"),
                                               Release("s1", 1.0, "at_least_one")]


def test_duplicates_are_refused_also_after_the_session_is_forgotten():
    led = Ledger()
    assert led.submit("d0", "d") and not led.submit("d0", "d")
    led.score("d0", 0, 1.0, True)
    assert led.tallies == {} and led.known("d0") and not led.submit("d0", "d")
    assert led.known_uids() == {"d0"}


def test_memory_is_bounded_by_open_sessions_and_keep_done():
    led = Ledger(keep_done=3)
    for k in range(50):
        run(led, f"s{k}", [-1.0, 1.0])
    assert led.tallies == {} and led.session_of == {}
    assert list(led.done) == ["s48-1", "s49-0", "s49-1"]  # the most recently finished
    assert led.submit("s0-0", "s0")  # forgotten: known no more


def test_feedback_on_held_released_and_forgotten_turns():
    led = Ledger()
    for uid in ("f0", "f1", "f2", "f3"):
        led.submit(uid, "f")
    led.score("f0", 0, 1.0, False)
    led.score("f1", 1, -1.0, False)
    led.score("f2", 2, -1.0, False)
    assert led.feedback("f3", 0.5) == ("unknown", [])  # not scored yet: the Scorer keeps it
    assert led.feedback("f0", -0.5) == ("rescored", [Release("f0", -0.5, "feedback")])
    assert led.feedback("f1", -0.2) == ("applied", [])  # still held, with its new reward
    # f0 is now negative too: no positive turn. f1 (-0.2) is the best, but a person rated
    # it: never lifted over that; the best turn the judge alone scored is (the latest of equals)
    assert led.score("f3", 3, -1.0, True) == [Release("f1", -0.2, "session_closed"),
                                              Release("f2", -1.0, "session_closed"),
                                              Release("f3", 1.0, "at_least_one")]
    assert led.feedback("f1", -1.0) == ("rescored", [Release("f1", -1.0, "feedback")])
    assert led.done.peek("f1") == -1.0


def test_only_liftable_turns_are_lifted():
    led = Ledger()
    for uid in ("h0", "h1"):
        led.submit(uid, "h")
    led.score("h0", 0, -1.0, False, liftable=False)  # a reward function's -1
    assert led.score("h1", 1, -1.0, True, liftable=False) == [
        Release("h0", -1.0, "session_closed"), Release("h1", -1.0, "session_closed")]
    led.restore("i0", "i", 0, -1.0, False, liftable=True)
    led.restore_feedback("i0", -1.0)  # a feedback line read back: a person's word
    led.restore("i1", "i", 1, -0.5, True, liftable=False)
    assert led.settle() == [Release("i0", -1.0, "session_closed"),
                            Release("i1", -0.5, "session_closed")]


def test_feedback_that_makes_a_session_positive_cancels_the_lift():
    led = Ledger()
    for uid in ("g0", "g1"):
        led.submit(uid, "g")
    led.score("g0", 0, -1.0, False)
    assert led.feedback("g0", 0.0) == ("applied", [])
    assert led.feedback("g0", 1.0) == ("applied", [Release("g0", 1.0, "feedback")])
    assert not led.is_held("g0")
    assert led.score("g1", 1, -1.0, True) == [Release("g1", -1.0, "session_closed")]


def test_restore_from_the_records_then_settle():
    led = Ledger()
    # finished session: score lines, then its releases (read back: nothing to do)
    led.restore("a0", "a", 0, -1.0, False)
    led.restore("a1", "a", 1, -1.0, True)
    led.restore_release("a0", -1.0)
    led.restore_release("a1", 1.0)
    # a crash between b's last score line and its release lines
    led.restore("b0", "b", 0, 1.0, False)
    led.restore_release("b0", 1.0)
    led.restore("b1", "b", 1, -1.0, False)
    led.restore("b2", "b", 2, 0.0, True)
    # an open session with a held turn, and one with a turn not scored yet
    led.restore("c0", "c", 0, -1.0, False)
    led.restore("e0", "e", 0, -1.0, False)
    led.restore("e1", "e", 1, None, True)
    led.restore_release("e1", None)
    assert led.submit("e2", "e")  # found unscored in conversations.jsonl
    assert "a" not in led.tallies and led.known("a1") and not led.submit("a1", "a")
    assert led.settle() == [Release("b1", -1.0, "session_closed"),
                            Release("b2", 0.0, "session_closed")]
    assert set(led.tallies) == {"c", "e"} and led.is_held("c0") and led.is_held("e0")
    assert led.score("e2", 2, -1.0, False) == [Release("e0", -1.0, "session_closed"),
                                               Release("e2", 1.0, "at_least_one")]


rewards = st.one_of(st.none(), st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]))


@settings(max_examples=100, deadline=None)
@given(sessions=st.lists(st.lists(rewards, min_size=1, max_size=6), min_size=1, max_size=5),
       order=st.randoms(use_true_random=False))
def test_every_scored_turn_is_released_exactly_once(sessions, order):
    """Any interleaving of sessions' scoring: each turn released once; a lift only in a
    session with no positive turn, at most one per session, on its best turn."""
    led = Ledger()
    events = []
    for s, rs in enumerate(sessions):
        for i, r in enumerate(rs):
            led.submit(f"{s}-{i}", str(s))
            events.append((f"{s}-{i}", i, r, i == len(rs) - 1))
    order.shuffle(events)
    out = [rel for uid, i, r, final in events for rel in led.score(uid, i, r, final)]
    assert sorted(r.uid for r in out) == sorted(e[0] for e in events)
    assert led.tallies == {} and led.pending == 0
    for s, rs in enumerate(sessions):
        lifted = [r for r in out if r.uid.startswith(f"{s}-") and r.reason == "at_least_one"]
        scored = [r for r in rs if r is not None]
        if not scored or max(scored) > 0:
            assert lifted == []
        else:
            (one,) = lifted
            assert rs[int(one.uid.split("-")[1])] == max(scored)


def test_a_session_closed_without_a_final_scored_turn_releases_what_it_held():
    # Its last main turn never reached the scorer (X-RL-Train: 0): the close event ends it.
    led = Ledger()
    assert run(led, "c", [-1.0, 0.0], final=False) == []
    assert led.is_held("c-0") and led.is_held("c-1")
    assert led.close("c") == [Release("c-0", -1.0, "session_closed"),
                              Release("c-1", 1.0, "at_least_one")]
    assert led.tallies == {} and led.close("c") == []


def test_a_close_while_a_turn_is_being_scored_waits_for_its_score():
    led = Ledger()
    led.submit("d0", "d")
    led.submit("d1", "d")
    assert led.score("d0", 0, -1.0, False) == []
    assert led.close("d") == []  # d1 still pending
    assert led.score("d1", 1, -1.0, False) == [Release("d0", -1.0, "session_closed"),
                                               Release("d1", 1.0, "at_least_one")]
