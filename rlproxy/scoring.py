"""Scoring math and prompts: judge prompts from a turn, vote parsing, majority, hints, rewards,
per-token advantages, the at-least-one rule. Pure functions only: no I/O, no models, no asyncio
(the Scorer in scorer.py runs them against judge backends and writes the records).

Reward of a turn (documented in the README):
  judge reward r_j = majority of valid votes (tie or no valid vote -> 0); turns without a next
  state are not judged. Explicit feedback r_e (POST /v1/feedback) and reward functions r_f
  (first non-None) combine with it: "override" takes the first present of r_e, r_f, r_j;
  "add" sums those present and clips to [-1, 1].
Per-token advantage (combine): A_t = w_opd * (teacher_lp_t - behaviour_lp_t) + w_rl * r, where
the OPD term is exactly 0 for a turn without teacher log-probs and the RL term 0 without reward.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

BOXED = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")
HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.S)


def load_prompts(folder: Path) -> dict[str, str]:
    folder = Path(folder)
    prompts = {}
    for name in ("judge", "hint"):
        path = folder / f"{name}.txt"
        if not path.exists():
            raise ValueError(f"missing judge prompt {path}; point --prm-prompts at a folder "
                             "with judge.txt and hint.txt")
        prompts[name] = path.read_text()
    return prompts


def trim_middle(text: str, limit: int) -> str:
    """Keep the start and the end: requests put the task first and the latest detail last."""
    if len(text) <= limit:
        return text
    half = (limit - 20) // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters trimmed ...]\n{text[-half:]}"


def user_request(messages: list[dict], limit: int) -> str:
    last = next((m for m in reversed(messages) if m["role"] == "user"), None)
    return trim_middle((last or {}).get("content") or "(no user message)", limit)


def assistant_output(choice: dict) -> str:
    parts = [choice["text"]] if choice["text"] else []
    for call in choice["tool_calls"]:
        parts.append(f"[tool call] {call['function']['name']}({call['function']['arguments']})")
    return "\n".join(parts) or "(empty output)"


def render_next_state(messages: list[dict], limit: int) -> str:
    blocks = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            role = f"tool result for {m.get('name') or m.get('tool_call_id') or 'a call'}"
        blocks.append(f"[{role}]\n{trim_middle(m.get('content') or '', limit)}")
    return "\n\n".join(blocks)


def fill_prompt(template: str, turn: dict, limit: int) -> str:
    choice = turn["choices"][turn.get("chosen_choice", 0)]
    values = {"{user_request}": user_request(turn["messages"], limit),
              "{assistant_output}": assistant_output(choice),
              "{next_state}": render_next_state(turn["next_state"] or [], limit)}
    for key, value in values.items():
        template = template.replace(key, value)
    return template


def parse_vote(text: str) -> int | None:
    """The last \\boxed{} decides; only 1, -1 and 0 are votes."""
    found = BOXED.findall(text or "")
    if not found:
        return None
    value = int(found[-1])
    return value if value in (1, -1, 0) else None


def majority(votes: list[int | None]) -> int:
    """Most common valid vote; a tie for the top or no valid vote gives 0."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def parse_hint(text: str) -> str | None:
    found = HINT.findall(text or "")
    hint = found[-1].strip() if found else ""
    return hint or None


def best_hint(texts: list[str]) -> str | None:
    """Of several hint answers, the longest valid hint (more hindsight, as the anchors did)."""
    hints = [h for h in (parse_hint(t) for t in texts) if h]
    return max(hints, key=len) if hints else None


def hinted_messages(messages: list[dict], hint: str) -> list[dict]:
    """The teacher's context: the turn's prompt with the hint added to its last message."""
    out = [dict(m) for m in messages]
    last = out[-1]
    last["content"] = f"{last.get('content') or ''}\n\n[Hint from hindsight] {hint}"
    return out


def final_reward(judge: int | None, function: float | None, feedback: float | None,
                 mode: str) -> float | None:
    present = [r for r in (feedback, function, judge) if r is not None]
    if not present:
        return None
    if mode == "override":
        return float(present[0])
    return max(-1.0, min(1.0, float(sum(present))))


def token_advantages(behaviour_lp: list[float], teacher_lp: list[float] | None,
                     reward: float | None, w_opd: float, w_rl: float) -> list[float] | None:
    """Per completion token; None when the turn has neither a teacher nor a reward."""
    if teacher_lp is None and reward is None:
        return None
    rl = w_rl * reward if reward is not None else 0.0
    if teacher_lp is None:
        return [rl] * len(behaviour_lp)
    return [w_opd * (t - b) + rl for t, b in zip(teacher_lp, behaviour_lp)]


def at_least_one(rewards: dict[str, tuple[int, float]]) -> str | None:
    """{uid: (turn index, reward)} of a closed session's scored turns -> the uid to lift to +1,
    or None when some turn is already positive (or none was scored). Ties: the latest turn."""
    if not rewards or any(r > 0 for _, r in rewards.values()):
        return None
    return max(rewards, key=lambda uid: (rewards[uid][1], rewards[uid][0]))
