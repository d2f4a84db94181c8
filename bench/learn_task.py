"""bench/learn.py's task: add two numbers from 2 to 20 and answer with just the sum.

One module, two users: `rlproxy serve` imports it as `--reward-function learn_task:reward_fn`
(learn.py copies this file into the run's temp dir and puts that dir on the server's
PYTHONPATH), and learn.py scores its held-out evaluations with `reward` directly, so training and
evaluation use the same rule. It knows nothing about HTTP or the server.

SmolLM2-135M-Instruct, measured before choosing (64 random sums; greedy with 32-token replies,
sampled with 20): 36% of greedy replies right (23/64, mean reward -0.13) and 12.5% of sampled
ones (16/128, mean -0.56); on learn.py's 32 held-out sums 10/32 greedy (-0.17) and 5/64 sampled
(-0.63). It often writes "12 + 6 = 18" and stops, but as often gets the sum wrong or rambles
("To solve this, we need to ...") past the budget. Single digits were too easy (32/48 greedy),
a two-digit plus a one-digit number too hard (4/64).
"""

from __future__ import annotations

import random
import re

LOW, HIGH = 2, 20  # operand range, both ends included
PROMPT = "What is {a} + {b}? Answer with just the number."
ASKED = re.compile(r"What is (\d+) \+ (\d+)\?")
NUMBER = re.compile(r"-?\d+")


def split_items(held_out: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out pairs, training pairs). A held-out pair's swap (b + a) is not trained on
    either, so the held-out score measures what carries over to unseen sums."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    held = pairs[:held_out]
    unseen = set(held) | {(b, a) for a, b in held}
    return held, [p for p in pairs if p not in unseen]


def messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(a=a, b=b)}]


def correct(text: str, finish_reason: str, a: int, b: int) -> bool:
    """The reply ended on its own (within the token budget) and its last number is a + b:
    "18", "12 + 6 = 18." and "The answer is 18" are right; "12 + 6 = 18 + 2 = 20" is not."""
    numbers = NUMBER.findall(text)
    return finish_reason == "stop" and bool(numbers) and int(numbers[-1]) == a + b


def reward(text: str, finish_reason: str, a: int, b: int) -> float:
    """+1 right; otherwise -1, plus 0.5 for ending within the budget and 0.5 for writing the sum
    somewhere. The shaping gives a rambling or wrong reply a gradient towards short and right."""
    if correct(text, finish_reason, a, b):
        return 1.0
    wrote_sum = str(a + b) in [n.lstrip("-") for n in NUMBER.findall(text)]
    return -1.0 + 0.5 * (finish_reason == "stop") + 0.5 * wrote_sum


def reward_fn(turn: dict, next_state, choice: int) -> float | None:
    """The server's reward function: the same rule on a recorded choice (None: not this task)."""
    user = next((m for m in reversed(turn["messages"]) if m["role"] == "user"), None)
    asked = ASKED.search((user or {}).get("content") or "")
    if asked is None:
        return None
    c = turn["choices"][choice]
    return reward(c["text"] or "", c["finish_reason"], int(asked[1]), int(asked[2]))
