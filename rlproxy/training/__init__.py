"""Training: scored items in, LoRA updates out, published to the engine.

Owns the training loop, the gradient math (chunked forward/backward, losses, schedules), the
journal, checkpoints and the eval gate. Knows nothing of HTTP or sessions.
"""
