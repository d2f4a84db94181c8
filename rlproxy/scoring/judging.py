"""Scoring math and prompts: judge prompts from a turn, log-prob verdicts and their
calibration, vote parsing, majority, hints, rewards, per-token advantages, the at-least-one
rule. Pure functions only: no I/O but reading the prompts, no models, no asyncio (the Scorer in
scoring/scorer.py runs them against judge backends and writes the records).

Reward of a turn (documented in the README):
  judge reward r_j, by --prm-verdict:
    logprob (default)  z = log p(label "worked") - log p(label "failed") at the label position
                       of prm_prompts/verdict.txt (one forward pass); P = sigmoid(scale * z +
                       bias) (the calibration in verdict.json for the judge model; none: 1, 0);
                       r_j = 2P - 1, the expected score with worked = +1 and failed = -1.
                       Undecided (no r_j) when neither label is among the log-probs read or the
                       margin |2P - 1| < --prm-min-margin.
    votes              the majority of valid votes; undecided (no r_j) on a tie, no valid vote
                       or a majority of 0.
  Turns without a next state are not judged. Explicit feedback r_e (POST /v1/feedback) and
  reward functions r_f (first non-None) combine with it: "override" takes the first present of
  r_e, r_f, r_j (and does not ask the judge when r_e or r_f is present); "add" sums those
  present and clips to [-1, 1].
Per-token advantage (combine): A_t = w_opd * (teacher_lp_t - behaviour_lp_t) + w_rl * a, where
the OPD term is exactly 0 for a turn without teacher log-probs and the RL term 0 without reward.
a = r for a lone choice (the trainer may then subtract its running mean), and for a request with
n > 1 whose scored choices number 2 or more, the group-relative advantage, over the choices with
a reward (std: the sample std, n - 1, as TRL's GRPO):
  baseline "group"                  a_i = r_i - mean(group)          (Dr. GRPO: no division)
  any other baseline (the default)  a_i = (r_i - mean(group)) / max(std(group), group_std_floor)
The divided form is the default because it learned at least as well on SmolLM2: in one side by
side bench/learn.py run (4 choices, lr 3e-5, 10 training minutes each) it ended at +0.48 sampled
held-out reward against +0.34 for Dr. GRPO, from -0.63 (intervals overlapping at every point).
A group whose rewards are all equal gives every choice exactly 0 (the trainer takes no step on a
batch of such). The floor (default STD_FLOOR = 0.1, 5% of the [-1, 1] reward range) keeps a
near-identical group from being blown up to full-size advantages: dividing by std + 1e-4, as
TRL does, turned a spread of 0.008 into advantages of order 1, and a group of such replies
degenerated; with the floor a spread below 0.1 gives advantages proportionally below 1 (at
most spread / 0.1 in size).

Choices of an n > 1 request that the conversation did not continue from have no next state of
their own; each is scored against the chosen choice's next state (the user's reply or tool
result to that one), or not at all:
  reward functions  every choice, always (they receive the choice);
  PRM judge         every choice with --score-all-choices (m votes each), else the chosen only;
  OPD               the one hint (written from the chosen choice's next state) is applied to
                    every choice's tokens with --score-all-choices, else the chosen only;
  feedback          the chosen choice only (it is about the reply the user saw);
  at-least-one      lifts the chosen choice only. A turn's choices are released together, when
                    its chosen choice is, and the group baseline is over the rewards released
                    (a lifted +1 included); feedback re-releases the chosen choice alone, against
                    the same group.
A choice with neither a reward nor teacher log-probs is not released.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from pathlib import Path

from rlproxy.scoring.notes import note_rule, without_notes
from rlproxy.settings import STD_FLOOR  # --group-std-floor's default: see the docstring

BOXED = re.compile(r"\\boxed\{\s*([+-]?\d+)\s*\}")
HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.S)


PROMPT_FILES = ("judge.txt", "hint.txt", "verdict.txt", "verdict.json")


def load_prompts(folder: Path) -> dict:
    """The judge's prompts of FOLDER: judge.txt (votes), hint.txt (OPD), verdict.txt (log-prob
    verdicts) and verdict.json (the verdict's label words and calibrations)."""
    folder = Path(folder)
    prompts: dict = {}
    for name in PROMPT_FILES:
        path = folder / name
        if not path.exists():
            raise ValueError(f"missing judge prompt {path}; point --prm-prompts at a folder "
                             f"with {', '.join(PROMPT_FILES)}")
        prompts[name.replace(".", "_")] = path.read_text()
    try:
        prompts["verdict_json"] = check_verdict_config(json.loads(prompts["verdict_json"]))
    except ValueError as e:
        raise ValueError(f"{folder / 'verdict.json'}: {e}") from None
    return prompts


def check_verdict_config(config) -> dict:
    """verdict.json: {"labels": {"good": 1, "bad": -1}, "calibration": {judge name:
    {"scale": a, "bias": b}}}: the label words the prompt ends on, and per judge model the
    Platt scaling that maps the log-odds of the two labels to a probability."""
    labels = config.get("labels") if isinstance(config, dict) else None
    if not isinstance(labels, dict) or sorted(labels.values()) != [-1, 1] or not all(
            isinstance(w, str) and w.strip() == w and w for w in labels):
        raise ValueError('"labels" must map two words to 1 and -1, e.g. '
                         '{"good": 1, "bad": -1}')
    calibration = config.get("calibration", {})
    if not isinstance(calibration, dict) or not all(
            isinstance(c, dict) and all(isinstance(c.get(k), (int, float))
                                        for k in ("scale", "bias"))
            for c in calibration.values()):
        raise ValueError('"calibration" must map judge model names to {"scale": number, '
                         '"bias": number}')
    return {"labels": labels, "calibration": calibration}


def trim_middle(text: str, limit: int) -> str:
    """Keep the start and the end: requests put the task first and the latest detail last."""
    if len(text) <= limit:
        return text
    half = (limit - 20) // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters trimmed ...]\n{text[-half:]}"


def user_request(messages: list[dict], limit: int) -> str:
    """The last user message that is no agent's note (scoring/notes.py): a reply that continues
    one cut at its budget is judged against what the user asked."""
    last = next((m for m in reversed(messages) if m["role"] == "user"
                 and note_rule(m) is None), None)
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


def fill_prompt(template: str, turn: dict, limit: int, choice: int | None = None) -> str:
    """The judge's prompt for one choice of TURN (default: the one its conversation continued
    from); every choice is judged against the same next state."""
    choice = turn["choices"][turn.get("chosen_choice", 0) if choice is None else choice]
    values = {"{user_request}": user_request(turn["messages"], limit),
              "{assistant_output}": assistant_output(choice),
              "{next_state}": render_next_state(without_notes(turn["next_state"] or []),
                                                limit)}
    for key, value in values.items():
        template = template.replace(key, value)
    return template


VERDICT_STATE_CHARS = 700  # the next state shown to the verdict prompt: small judges, short


def render_next_state_inline(messages: list[dict], limit: int) -> str:
    """The next state as the verdict prompt shows it: its messages on one line, each headed by
    its role said plainly ("(user's reply)", "(tool's result)"), whitespace folded, each
    trimmed to an equal share of LIMIT keeping its start and end (a test run's or a
    traceback's verdict is often its last line)."""
    share = max(80, limit // max(1, len(messages)))
    parts = []
    for m in messages:
        role = "tool's result" if m["role"] == "tool" else f"{m['role']}'s reply"
        text = " ".join(content_text(m.get("content")).split()) or "(empty)"
        parts.append(f"({role}) {' '.join(trim_middle(text, share).split())}")
    return " ".join(trim_middle(" ".join(parts), 2 * limit).split())  # many messages: capped


def content_text(content) -> str:
    """A message's content as text: None is "", a list of parts the text of its text parts."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else str(content)


def fill_verdict_prompt(template: str, turn: dict, limit: int,
                        choice: int | None = None) -> str:
    """The verdict prompt for one choice of TURN: the template's few-shot examples, then this
    turn's next state and step, ending where the label word goes."""
    choice = turn["choices"][turn.get("chosen_choice", 0) if choice is None else choice]
    values = {"{next_state}": render_next_state_inline(without_notes(turn["next_state"] or []),
                                                       VERDICT_STATE_CHARS),
              "{assistant_output}": " ".join(trim_middle(assistant_output(choice),
                                                         300).split()),
              "{user_request}": " ".join(user_request(turn["messages"], 300).split())}
    for key, value in values.items():
        template = template.replace(key, value)
    return template.rstrip()


def split_head(prompt: str) -> tuple[str, str]:
    """A filled verdict prompt cut where the turn's own part starts, just before its last blank
    line: (the constant few-shot head, this turn's tail, which starts with that blank line).
    The local judge keeps the head's KV. Cut before the blank line, not after it: a head ending
    in "\n\n" would tokenize it as one token where the whole prompt has two (byte-level BPE);
    the judge checks that the two parts tokenize as the whole does before it reuses the head."""
    cut = prompt.rfind("\n\n")
    return (prompt[:cut], prompt[cut:]) if cut > 0 else ("", prompt)


def label_variants(word: str) -> list[str]:
    """The spellings of a label word that count as it: after a "Label:" prefix the model writes
    " good", sometimes " Good"; a server may strip the space."""
    return [" " + word, word, " " + word.capitalize(), word.capitalize()]


def normal_token(token: str) -> str:
    """A token string as servers spell it ("Ġgood" from byte-level BPE, "▁good" from
    SentencePiece) -> " good"."""
    return token.replace("\u0120", " ").replace("\u2581", " ")


def found_labels(top: dict[str, float], labels: dict[str, int]) -> dict[int, list[float]]:
    """The log-probs in TOP of each polarity's spellings: {1: [...], -1: [...]}."""
    found: dict[int, list[float]] = {1: [], -1: []}
    for token, lp in top.items():
        spelled = normal_token(token)
        for word, polarity in labels.items():
            if spelled in label_variants(word) or spelled.strip().lower() == word.lower():
                found[polarity].append(lp)
                break
    return found


def label_logprobs(top: dict[str, float], labels: dict[str, int]) -> dict[int, float] | None:
    """{token: log-prob} at the label position -> {1: log p(good), -1: log p(bad)}, each the
    log of the summed probability of the label's spellings. A label missing from TOP (a URL
    judge's top-k) gets an upper bound: no more than the smallest log-prob in TOP (it ranked
    below all of them) nor than the mass TOP leaves; `read_verdict` then trusts the verdict only
    in the direction of the label that was found. None when neither label is there."""
    found = found_labels(top, labels)
    if not found[1] and not found[-1]:
        return None
    left = 1.0 - sum(math.exp(lp) for lp in top.values())
    floor = min(min(top.values()), math.log(left) if left > 1e-12 else -27.6)
    return {p: _logsumexp(lps) if lps else floor for p, lps in found.items()}


def _logsumexp(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def calibrated(z: float, calibration: dict | None) -> float:
    """P(good) from the log-odds z = log p(good) - log p(bad), by Platt scaling
    sigmoid(scale * z + bias); without a calibration, sigmoid(z) (the raw two-label odds)."""
    c = calibration or {"scale": 1.0, "bias": 0.0}
    x = c["scale"] * z + c["bias"]
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def read_verdict(top: dict[str, float] | None, labels: dict[str, int],
                 calibration: dict | None, min_margin: float) -> dict:
    """One log-prob verdict: the label probabilities, the calibrated P(good), the reward (the
    expected score 2P - 1 in [-1, 1], +1 for good and -1 for bad), the margin |2P - 1|, and
    whether it is decided (a verdict whose margin is at least MIN_MARGIN). Undecided: the reward
    is None, so the judge gives the turn nothing to train on and at-least-one never lifts it."""
    lps = label_logprobs(top, labels) if top else None
    if lps is None:
        return {"label_logprobs": None, "p_good": None, "margin": None, "decided": False,
                "reward": None}
    p = calibrated(lps[1] - lps[-1], calibration)
    reward = 2 * p - 1
    decided = abs(reward) >= min_margin
    missing = [polarity for polarity, lps in found_labels(top, labels).items() if not lps]
    if missing and (reward > 0) == (missing[0] == 1):
        decided = False  # a bound on the missing label cannot support its own direction
    return {"label_logprobs": {"1": round(lps[1], 4), "-1": round(lps[-1], 4)},
            "p_good": round(p, 4), "margin": round(abs(reward), 4), "decided": decided,
            "reward": round(reward, 4) if decided else None}


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


def at_least_one(rewards: dict[str, tuple[int, float]],
                 liftable: set[str] | None = None) -> str | None:
    """{uid: (turn index, reward)} of a closed session's scored turns -> the uid to lift to +1,
    or None when some turn is already positive (or none was scored). Only a LIFTABLE turn is
    lifted (default: any): one whose reward is the judge's decided verdict alone, never one a
    person rated (feedback) or a reward function scored. Ties: the latest turn."""
    if not rewards or any(r > 0 for _, r in rewards.values()):
        return None
    candidates = [u for u in rewards if liftable is None or u in liftable]
    if not candidates:
        return None
    return max(candidates, key=lambda uid: (rewards[uid][1], rewards[uid][0]))


# ---- group baselines (GRPO) and what is released to the trainer ----

def group_baseline(rewards: list[float | None], mode: str,
                   std_floor: float = STD_FLOOR) -> tuple[float | None, float | None]:
    """(baseline, scale) for the choices of one request: a_i = (r_i - baseline) / scale.
    (None, None) when fewer than 2 choices have a reward: not baselined here (the trainer's
    own --baseline then applies). Any mode uses the group mean for a group of 2 or more, and
    divides by the group's std, never by less than the floor, except "group" (Dr. GRPO)."""
    group = [r for r in rewards if r is not None]
    if len(group) < 2:
        return None, None
    if max(group) == min(group):
        return group[0], None  # every a_i is exactly 0: the group carries no signal
    mean = statistics.fmean(group)
    if mode == "group":
        return mean, None
    return mean, max(statistics.stdev(group), std_floor)  # tiny spreads stay tiny


def relative(reward: float | None, baseline: float | None, scale: float | None) -> float | None:
    """The RL advantage of one choice from its release: reward, less baseline, over scale."""
    if reward is None:
        return None
    a = reward - baseline if baseline is not None else reward
    return a / scale if scale is not None else a


def group_advantages(rewards: list[float | None], mode: str,
                     std_floor: float = STD_FLOOR) -> list[float | None]:
    baseline, scale = group_baseline(rewards, mode, std_floor)
    return [relative(r, baseline, scale) for r in rewards]


def choice_key(uid: str, choice: int, chosen: int) -> str:
    """What the trainer knows a released choice by: the uid for the chosen choice."""
    return uid if choice == chosen else f"{uid}/{choice}"


def choice_rewards(line: dict, n: int) -> list[float | None]:
    """Every choice's reward from a score line (None: not scored)."""
    rewards: list[float | None] = [None] * n
    rewards[line["chosen_choice"]] = line["reward"]
    for other in line.get("other_choices") or []:
        rewards[other["choice"]] = other["reward"]
    return rewards


def choice_teacher_logprobs(line: dict, choice: int) -> list[float] | None:
    if choice == line["chosen_choice"]:
        return line.get("teacher_logprobs")
    other = next((o for o in line.get("other_choices") or [] if o["choice"] == choice), {})
    return other.get("teacher_logprobs")


def release_lines(line: dict, n: int, reward: float | None, reason: str, mode: str,
                  with_others: bool, std_floor: float = STD_FLOOR) -> list[dict]:
    """The `release` lines of one turn: its chosen choice with REWARD (after at-least-one or
    feedback), and with WITH_OTHERS each other choice that has something to train (a reward or
    teacher log-probs), reason "group". The baseline is the group's over the rewards released
    (`group_baseline`; the lines record it and the scale, so a restart rebuilds the same
    advantages whatever the floor is then); the chosen choice's line comes last."""
    chosen = line["chosen_choice"]
    rewards = choice_rewards(line, n)
    rewards[chosen] = reward
    baseline, scale = group_baseline(rewards, mode, std_floor)
    out = []
    for i in range(n):
        if i == chosen or not with_others:
            continue
        if rewards[i] is None and choice_teacher_logprobs(line, i) is None:
            continue
        out.append(_release(line, i, rewards[i], "group", baseline, scale))
    return out + [_release(line, chosen, reward, reason, baseline, scale)]


def _release(line: dict, i: int, reward, reason: str, baseline, scale) -> dict:
    if reward is None:
        baseline = scale = None
    return {"kind": "release", "uid": line["uid"], "session_id": line["session_id"],
            "index": line["index"], "choice": i,
            "key": choice_key(line["uid"], i, line["chosen_choice"]), "reward": reward,
            "reason": reason, "baseline": baseline, "scale": scale}


def released_item(turn: dict, score: dict, release: dict, w_opd: float, w_rl: float,
                  update: bool = False) -> dict | None:
    """What the trainer gets for one released choice (None: nothing to train): the turn record,
    the choice, its key, reward, per-token advantages, whether a group baseline was already
    subtracted, and its teacher log-probs. Rebuilds exactly from the records after a restart:
    the turn's line in conversations.jsonl, its `score` line and the `release` line."""
    i = release.get("choice", turn.get("chosen_choice", 0))
    score = {"chosen_choice": turn.get("chosen_choice", 0), **score}  # older lines lack it
    teacher = choice_teacher_logprobs(score, i)
    baseline, scale = release.get("baseline"), release.get("scale")
    advantages = token_advantages(turn["choices"][i]["logprobs"], teacher,
                                  relative(release["reward"], baseline, scale), w_opd, w_rl)
    if advantages is None:
        return None
    return {"turn": turn, "choice": i,
            "key": release.get("key") or choice_key(turn["uid"], i, score["chosen_choice"]),
            "reward": release["reward"], "advantages": advantages,
            "baselined": baseline is not None, "teacher_logprobs": teacher, "update": update}
