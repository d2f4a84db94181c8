"""Serving: the model and the engine thread that decodes every live request.

Owns model loading (GGUF, named and generated models, LoRA layers), the engine's batch,
prefill, sampling, prompt rendering and the text that comes back. Knows nothing of HTTP,
sessions, scoring or training: the front doors hand it token ids, the trainer hands it
adapter weights.
"""
