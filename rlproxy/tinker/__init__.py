"""The Tinker training API (`tinker` SDK) under /api/v1, on the proxy's own server and port.

routes.py maps the HTTP protocol onto the parts rlproxy already has: models.py (LoRA models on
the shared frozen base, trained with rlproxy.losses on one worker thread), sampling.py (saved
sampler weights served by the engine class), futures.py (request ids and long-polled results)
and wire.py (the SDK's protobuf bodies). The SDK's `tinker` package is an optional extra.
"""
