"""Training: scored items in, LoRA updates out, published to the engine.

loop.py is the trainer's thread and its loop, over parts that each own one kind of state:
books.py (which items wait, are gathered, trained, skipped or quarantined), runner.py (one batch
to an outcome, retries included), publisher.py (after each step: publish, sync, the eval gate),
saving.py (checkpoints and resume), control.py (the operator's actions: pause, rollback, a
checkpoint now), status.py (status as an enum and a message, the counters); restart.py reads
training.jsonl back. learner.py computes gradients and applies updates behind one protocol, here
or elsewhere (chunked_grad.py, losses.py, schedule.py, checkpoints.py); gate.py measures a
candidate adapter (degeneracy.py); journal.py keeps the books of steps; items.py and examples.py
turn scored items into training examples; pacing.py keeps serving first. Knows nothing of HTTP
or sessions.
"""
