"""Scoring: a turn and its next state in, a reward and per-token advantages out.

Owns the scorer worker, the scoring math (votes, majority, hints, group baselines), the
at-least-one ledger, judge and teacher backends, and user reward functions. Released items go
to the sink it was built with (the trainer, wired in app.py); it knows nothing of training.
"""
