"""`rlproxy connect AGENT`: point a coding agent at a running rlproxy by writing the agent's own
configuration file, where the agent reads it.

command.py is the flow (ask the server what it serves, read the agent's file, merge, show the
diff, back up, write atomically, undo, print how to run the agent); agents.py says, per agent
(Codex CLI, Claude Code, OpenCode, OpenClaw, Hermes Agent), where its file lives and what goes
into it; formats.py reads and writes TOML, JSON and YAML keeping the user's other settings and,
where the format has them, comments; check.py runs one turn through the agent and finds it in
the server's sessions.

Talks to the server only over HTTP (/v1/models, /v1/sessions), like any client; imports nothing
of the server. Owns no agent: it installs none and starts one only for `--check`.
"""
