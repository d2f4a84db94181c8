"""A clean stop (issue 41): SIGTERM during a long training step ends the step at its next unit
(training/pacing.py), within --drain-timeout-s, its turn uncharged in the train journal, and the
process exits 0 with nothing printed by BLAS or MLX at exit. Before, the stop waited up to 120 s
for the step, logged an ERROR, and a step still running at exit aborted the process ("terminate
called without an active exception") or had OpenBLAS print "BLAS : Bad memory unallocation!".

The real `rlproxy serve` as a subprocess (rlproxy.ops.served), trained by a reward function on
one turn of ~8,000 prompt tokens with --prompt-grad full: about 30 s a step on the shared 2-core
test machine, in units of --train-chunk-tokens positions."""

from __future__ import annotations

import random
import signal
import time

import requests

from rlproxy.ops.served import Served
from rlproxy.training.journal import JOURNAL, StepJournal
from test_durability import read_lines

DRAIN_S = 8.0
WORDS = 8000  # one token each with the embedded tokenizer


def test_sigterm_mid_step_exits_within_the_drain_with_the_turn_uncharged(tmp_path):
    (tmp_path / "reward_one.py").write_text("def reward(turn, next_state):\n    return 1.0\n")
    data = tmp_path / "data"
    flags = ("--batch-size", "1", "--no-judge", "--no-at-least-one", "--reward-function",
             "reward_one:reward", "--baseline", "none", "--no-prefix-cache",
             "--prompt-grad", "full", "--save-interval", "1000",
             "--drain-timeout-s", str(DRAIN_S), "--log-level", "INFO")
    server = Served(data, *flags, python_path=(tmp_path,))
    try:
        rng = random.Random(0)
        text = " ".join(rng.choice(["the", "of", "and", "to", "in", "is"]) for _ in range(WORDS))
        r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8},
            headers={"X-Session-Id": "long", "X-Session-Done": "1"})
        assert r.status_code == 200, r.text
        uid = r.headers["X-Turn-Uid"]
        deadline = time.monotonic() + 60
        while not [ln for ln in journal(data) if ln["kind"] == "step_start"]:
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.05)
        time.sleep(1.0)  # inside the step, units in
        assert not [ln for ln in journal(data) if ln["kind"] == "step_end"], \
            "the step ended before the signal: make the turn longer"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=300)
        took = time.monotonic() - signalled
    finally:
        server.stop()
    out = server.output()
    assert rc == 0, out[-3000:]
    assert took < DRAIN_S, f"exited {took:.1f} s after SIGTERM (drain {DRAIN_S:g} s)"
    for needle in ("BLAS :", "Bad memory unallocation", "terminate called", "Fatal Python error",
                   "ERROR"):
        assert needle not in out, out[-3000:]
    assert "ended by the stop: stopped after unit" in out
    ends = [ln for ln in journal(data) if ln["kind"] == "step_end"]
    assert [(e["ok"], e["charged"], e.get("stopped")) for e in ends] == [(False, False, True)]
    restarted = StepJournal(data)  # what the next start reads: nothing charged, no death
    try:
        assert not restarted.failures and not restarted.suspects and uid not in \
            restarted.quarantined
    finally:
        restarted.close()


def journal(data) -> list[dict]:
    path = data / JOURNAL
    return read_lines(path) if path.exists() else []
