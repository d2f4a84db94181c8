"""Sessions, their threads and turns: where a request belongs, and each turn's next state.

store.py keeps the open sessions and files turns (conversations.jsonl, the pending_turns.jsonl
journal); turn.py holds the Turn/Thread/Session records and pure lookups over them; threads.py the
message rules (prefix matching, side calls, compactions); replay.py the X-Request-Id replay cache.
A finished trainable turn goes to whatever sink the store was built with (the scorer, wired in
app.py): it knows nothing of HTTP, scoring or training.
"""
