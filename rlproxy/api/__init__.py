"""The front doors: one module per API dialect (chat, responses, messages).

Each dialect parses its own request shape, translates it into the one internal
`protocol.ChatRequest` (messages + tools), hands it to `turns.serve_turn` -- the single path
that templates, generates, files the turn into its session and records it -- and writes the
engine's output back in its own dialect. No dialect generates or records on its own.

Before any of them, `edge.py` reads every request body once (timeouts, content encodings,
JSON depth, admission control, aiohttp's own parse errors as JSON); `feedback.py` takes
explicit rewards (POST /v1/feedback); `tags.py` parses the session headers.
"""
