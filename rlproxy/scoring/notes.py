"""Agents' own control notes, and replies cut at their budget: what the judge is not asked about.

An agent steers its own loop with notes it sends as user messages: Hermes Agent answers a reply
cut at its completion budget with "[System: Your previous response was truncated by the output
length limit. Continue exactly where you left off...]" and asks again with a larger budget. Such a
note is not what a user or a tool said about the turn before it: judged as that turn's next
state, it grades the reply by the agent's bookkeeping. The rules (the README's "Next states that
are not": keep both in step):

- `system_note`: a user message that opens with "[System:" -- Hermes Agent 0.19's continuation
  after a cut reply, its notes after a stream cut mid-reply or a tool call too large for one
  reply, and the nudges of its loop ("[System: Continue now...", "[System: You edited code...");
- `task_list`: Hermes Agent's "[Your active task list was preserved across context compression]";
- `system_reminder`: a user message made only of <system-reminder>...</system-reminder> blocks
  (Claude Code's reminders about its todo list and changed files).

A next state made only of notes is no next state: the turn is `cut` ("agent_note") and the judge
is not asked; notes beside other messages are left out of what the judge reads, and the user
request the judge is shown is the last user message that is no note. A reply that ended at its
completion budget (finish_reason "length") is `cut` too ("length"): the judge would grade half a
reply, so with --no-judge-cut-turns it is not asked (DAPO's "overlong filtering": no gradient
from a reply whose end was never seen; the server's default still judges it until a learning
curve on the real model says otherwise). Either way explicit feedback and reward
functions still score the turn, so a rule of the operator's can still train it.

Pure functions over templated messages and turn records; owns no state, writes nothing
(scoring/scorer.py applies them, scoring/judging.py fills the judge's prompts with them).
"""

from __future__ import annotations

import re

NOTE_RULES = (
    ("system_note", re.compile(r"\[System:", re.IGNORECASE)),
    ("task_list", re.compile(r"\[Your active task list was preserved across context "
                             r"compression\]\s*\Z")),
    ("system_reminder", re.compile(r"(?:<system-reminder>.*?</system-reminder>\s*)+\Z",
                                   re.DOTALL)),
)


def note_rule(message: dict) -> str | None:
    """The rule by which MESSAGE is an agent's own note (NOTE_RULES), or None."""
    if message["role"] != "user":
        return None
    text = (message.get("content") or "").strip()
    return next((name for name, rule in NOTE_RULES if rule.match(text)), None)


def without_notes(messages: list[dict]) -> list[dict]:
    return [m for m in messages if note_rule(m) is None]


def cut(record: dict, choice: int, judge_cut_turns: bool = False) -> str | None:
    """Why the judge is not asked about CHOICE of the turn RECORD: "length" (it ended at its
    completion budget, and --judge-cut-turns is off), "agent_note" (what followed it is only
    the agent's own notes), or None."""
    if record["choices"][choice].get("finish_reason") == "length" and not judge_cut_turns:
        return "length"
    if record["next_state"] and not without_notes(record["next_state"]):
        return "agent_note"
    return None
