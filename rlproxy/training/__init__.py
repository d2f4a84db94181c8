"""Training: scored items in, LoRA updates out, published to the engine.

loop.py is the trainer (its thread, batches and steps) and control.py its changes of course
(failures, the eval gate's verdicts, the operator's actions, restarts); learner.py computes
gradients and applies updates (chunked_grad.py, losses.py, schedule.py, checkpoints.py); gate.py
measures a candidate adapter (degeneracy.py); journal.py keeps the books of steps; items.py and
examples.py turn scored items into training examples; pacing.py keeps serving first. Knows
nothing of HTTP or sessions.
"""
