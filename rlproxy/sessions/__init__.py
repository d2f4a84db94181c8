"""Sessions, their threads and turns: where a request belongs, and each turn's next state.

Owns the session store and its rules (side calls, thread continuation, idle close) and writes
sessions.jsonl/trajectories. A finished main turn goes to whatever sink it was built with (the
scorer, wired in app.py); it knows nothing of scoring or training.
"""
