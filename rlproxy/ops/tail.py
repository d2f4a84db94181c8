"""`rlproxy records tail`: a data dir's turns as a person reads them, each with where it stands.

A recorded turn (conversations.jsonl) shows its request, its reply and its next state, then its
reward and why: the judge's verdict or votes, feedback, a reward function, at-least-one, a turn
left unjudged (cut at its budget, or followed by the agent's own note only: scoring/notes.py),
rescored by feedback after scoring (a `rescore` line), or not trained at all (a side turn, the
X-RL-Train header ...); a turn not scored yet says it waits for the judge. A turn still waiting
for its next state (pending_turns.jsonl) is shown too, marked pending. With --follow, new turns,
pending turns and rewards are printed as their lines are written.

Reads the three record files and nothing else (no server); never writes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import orjson

from rlproxy.paths import CONVERSATIONS, PENDING, SCORES
from rlproxy.records import TurnLines


def short(text, limit: int = 80) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def number(r) -> str:
    return "none" if r is None else f"{r:+.2f}".rstrip("0").rstrip(".")


class Lines:
    """A record file read on from where it was last read: complete lines only (one being
    written waits for its newline), JSON objects only."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(value, dict):
                out.append(value)
        return out


class Scores:
    """prm_scores.jsonl by turn uid: its score line, its latest rescore and the latest release
    of the choice the conversation continued from (what training was handed)."""

    def __init__(self):
        self.score: dict[str, dict] = {}
        self.rescore: dict[str, dict] = {}
        self.release: dict[str, dict] = {}

    def add(self, line: dict) -> str | None:
        """Take one line; the uid of the turn whose reward it changes, or None."""
        kind, uid = line.get("kind"), line.get("uid")
        if kind == "score":
            self.score[uid] = line
        elif kind == "rescore":
            self.rescore[uid] = line
        elif kind == "release" and line.get("key", uid) == uid:
            self.release[uid] = line
        else:
            return None
        return uid

    def reward(self, turn: dict) -> str:
        """The turn's reward and why, in one line."""
        uid = turn["uid"]
        if turn.get("turn_type") != "main":
            return f"not trained: a side turn ({turn.get('side_rule') or 'header'})"
        if turn.get("no_train"):
            return f"not trained: {turn['no_train']}"
        line = self.score.get(uid)
        if line is None:
            return "waiting for the judge (not scored yet)"
        rescore, release = self.rescore.get(uid), self.release.get(uid)
        reward = (release or rescore or line)["reward"]
        why = [why_scored(line, rescore, turn)]
        if release is not None and release.get("reason") == "at_least_one":
            why.append("lifted to +1 by at-least-one")
        if reward is None:
            return "reward none, not trained: " + "; ".join(w for w in why if w)
        state = "trained with" if release is not None else "held until its session closes"
        return f"reward {number(reward)}, {state}: " + "; ".join(w for w in why if w)


def why_scored(line: dict, rescore: dict | None, turn: dict) -> str:
    """What gave a score line its reward, most decisive first."""
    if rescore is not None:
        return (f"feedback {number(rescore['feedback'])} after scoring (rescored; the score "
                f"line said {number(rescore['was'])})")
    if line.get("feedback") is not None:
        return f"feedback {number(line['feedback'])}"
    if line.get("function_reward") is not None:
        return f"reward function {number(line['function_reward'])}"
    cut = line.get("cut")
    if cut == "length":
        return "not judged: the reply was cut at its completion budget"
    if cut == "agent_note":
        return "not judged: only the agent's own note followed (no next state)"
    verdict, votes = line.get("verdict"), [v.get("vote") for v in line.get("votes") or []]
    if line.get("judged") and verdict is not None:
        p = verdict.get("p_good")
        said = "undecided" if line.get("judge_reward") is None else "judge"
        return f"{said}: P(worked) {p:.2f}" if p is not None else f"{said}: no label read"
    if line.get("judged"):
        return f"judge votes {votes}" + (" (undecided)" if line.get("judge_reward") is None
                                         else "")
    if line.get("teacher") is not None:
        return "teacher log-probs (OPD)"
    if not turn.get("next_state"):
        return f"not judged: no next state ({turn.get('end') or 'none'})"
    return "not judged (the judge is off)"


def format_turn(r: dict, status: str | None = None) -> str:
    """A turn in five lines: when, session, index, type and sizes; the request; the reply; what
    followed (or why nothing did); STATUS (its reward and why, or that it is pending)."""
    choice = r["choices"][r.get("chosen_choice", 0)]
    when = time.strftime("%H:%M:%S", time.localtime(r["timings"]["received"]))
    asked = next((m["content"] for m in reversed(r["messages"]) if m["role"] == "user"), "")
    calls = " ".join(f"{c['function']['name']}({short(c['function']['arguments'], 40)})"
                     for c in choice["tool_calls"])
    said = short(choice["text"], 60) + (f" [calls {calls}]" if calls else "")
    if choice.get("finish_reason") == "length":
        said += " [cut at its budget]"
    if r["next_state"] is None:
        after = f"(no next state: {r['end']})" if r.get("end") else "(none yet)"
    else:
        after = " ".join(f"{m['role']}: {short(m.get('content'), 40)}" for m in r["next_state"])
    step = f" step {r['step_index']}" if r.get("step_index") is not None else ""
    text = (f"{when} {r['session_id']} #{r['index']}{step} {r['turn_type']} "
            f"{len(r['prompt_ids'])}+{len(choice['completion_ids'])} tok\n"
            f"    user: {short(asked)}\n    assistant: {said}\n    next: {after}")
    return text + (f"\n    {status}" if status else "")


def say(text: str) -> None:
    print(text, flush=True)  # `tail -f | grep`: each turn as it comes


def tail(data_dir: Path, session: str | None = None, follow: bool = False,
         out: Callable[[str], None] = say, poll_s: float = 0.5) -> None:
    """Print DATA_DIR's turns (SESSION's only, when given): the recorded ones with their
    rewards, then those still pending; with FOLLOW, what is written after, until interrupted."""
    conversations, journal, scores_file = (Lines(Path(data_dir) / name)
                                           for name in (CONVERSATIONS, PENDING, SCORES))
    scores, recorded, shown = Scores(), {}, set()
    turns = TurnLines(Path(data_dir) / CONVERSATIONS)  # a line may extend an earlier turn's
    pending: dict[str, dict] = {}  # journaled, not tombstoned, not recorded

    def mine(r: dict) -> bool:
        return session is None or r.get("session_id") == session

    def read() -> tuple[list[dict], list[str]]:
        changed = [uid for line in scores_file.new() if (uid := scores.add(line))]
        new = [r for r in (turns.full(r) for r in conversations.new()
                           if r.get("kind", "turn") == "turn" and mine(r)) if r is not None]
        for r in new:
            recorded[r["uid"]] = r
            pending.pop(r["uid"], None)
        for entry in journal.new():
            if entry.get("kind") == "turn" and mine(entry) and entry["uid"] not in recorded \
                    and (full := turns.full(entry)) is not None:
                pending[entry["uid"]] = full
            elif entry.get("kind") == "done":
                pending.pop(entry.get("uid"), None)
        return new, changed

    new, _ = read()
    for r in new:
        out(format_turn(r, scores.reward(r)))
    for r in pending.values():
        out(format_turn(r, "pending: waiting for its next state"))
    shown |= set(recorded) | set(pending)
    while follow:
        time.sleep(poll_s)
        new, changed = read()
        for r in new:
            out(format_turn(r, scores.reward(r)))
        for uid, r in pending.items():
            if uid not in shown:
                out(format_turn(r, "pending: waiting for its next state"))
        for uid in dict.fromkeys(changed):  # a reward that came after its turn was shown
            if uid in recorded and recorded[uid] not in new:
                r = recorded[uid]
                out(f"{time.strftime('%H:%M:%S')} {r['session_id']} #{r['index']} "
                    f"{scores.reward(r)}")
        shown |= set(recorded) | set(pending)
