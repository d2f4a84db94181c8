"""`rlproxy demo`: watch the proxy learn, on any model (SmolLM2 by default, `--model tiny` for the
generated one), with no network beyond 127.0.0.1.

Starts the real app in-process (the same `create_app` as `rlproxy serve`, on a free port), and a
scripted weather agent that talks to it over real HTTP (aiohttp's client: the openai SDK is only a
test dependency) the way an agent does: sessions (`X-Session-Id`, `X-Session-Done` on the last
request), a tool schema, an assistant tool call and its tool result in the history. The reward is
verifiable and needs no judge: the share of the reply's tokens (the served model's tokens) that
are numbers ("answer with the figures"), mapped to [-1, 1]; the scorer calls `digit_reward` on
every turn and the trainer runs PPO steps on them. Every few steps the demo samples FRESH replies
with `X-RL-Opt-Out: 1` (never recorded, never trained) and measures the same reward on them; it
prints one line per measurement, writes the curve as JSON and as a small SVG chart, and shuts the
app down cleanly. The learning rate and the default number of steps differ between the generated
models and a real one (`recipe`), each measured.

With `guard` (`rlproxy demo --guard`) the eval gate is on and the learning rate is set too high
(demo/guard.py): the gate refuses candidates, rolls back and halves the rate, and the printed
curve and the chart mark each rollback.

Owns only the scripted agent, the reward, the measurement and the chart; serving, scoring and
training are the real modules, unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from aiohttp import ClientSession, ClientTimeout, web

from rlproxy import paths
from rlproxy.demo import guard as demo_guard
from rlproxy.ops import progress
from rlproxy.settings import load_settings
from rlproxy.training.checkpoints import latest_checkpoint

REWARD_FUNCTION = "rlproxy.demo.run:digit_reward"
MAX_TOKENS = 16  # per reply: short replies keep a 2-core CPU at several PPO steps a minute
EVAL_SAMPLES = 16  # fresh replies per measurement
AGENTS = 4  # sessions run at once; 2 trained turns each, so one round fills a batch of 8
BATCH_SIZE = 2 * AGENTS
# Measured here (tiny model, 2 cores, default LoRA: rank 8, scale 20, every projection; reward on
# fresh samples after 30 on-policy steps, 16-token replies): 1e-3 ended at +0.79..+0.99 in 8 of
# 8 runs; 2e-3 and 3e-3 were less reliable (-0.90..+0.96 in 6 runs; one 3e-3 run reached +0.91,
# then fell back to -0.13). The reward takes off suddenly, somewhere between steps 8 and 28.
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Recipe:
    """What differs between the generated random models and a real one, measured on each."""
    learning_rate: float  # --guard's, too high on purpose, is one for both (demo/guard.py)
    steps: int  # when --steps is not given


GENERATED = Recipe(LEARNING_RATE, steps=30)
# Measured here (SmolLM2-135M-Instruct, float32, 2 cores shared with other work; same LoRA,
# batches and 16-token replies; the base model scores -0.87 on the fresh samples, most replies
# holding no digit, so the reward has room): 5e-5 reached -0.55 after 12 steps (replies like
# 'Dakar is approximately 27°C (79°F)'); 1e-4 reached +0.84 and -0.09 after 6 steps, +1.00 after
# 10 and 12 (2 runs; replies of digits only). 2e-4 collapsed the replies to whitespace in a
# by-hand run. A step with its share of sampling took 30-100 s here, 12 steps 12 minutes: 30
# would take half an hour, so 12 by default.
REAL = Recipe(learning_rate=1e-4, steps=12)


def recipe(model: str) -> Recipe:
    from rlproxy.serving.embedded_model import SIZES

    return GENERATED if model in SIZES else REAL


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city: temperature (C), humidity (%), wind (km/h)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
SYSTEM = ("You are a weather assistant. Call get_weather, then answer with the figures: "
          "temperatures, percentages and speeds as numbers.")
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Tokyo", "Cairo", "Quito", "Perth", "Seoul",
          "Dakar", "Hanoi", "Turin", "Austin", "Bergen", "Kyoto", "Porto"]


# ---- the verifiable reward ----

def is_number_token(piece: bytes) -> bool:
    """A token that writes a number: '7', ' 42', '2024' (surrounding whitespace allowed)."""
    piece = piece.strip()
    return bool(piece) and piece.isdigit()  # bytes.isdigit: ASCII 0-9 only


def share_reward(hits: list[bool]) -> float:
    """Share of target tokens, mapped from [0, 1] to [-1, 1]; an empty reply scores -1."""
    return 2.0 * sum(hits) / len(hits) - 1.0 if hits else -1.0


@functools.cache
def number_token_ids(model_dir: Path) -> frozenset[int]:
    """Ids of the number tokens of MODEL_DIR's tokenizer."""
    from transformers import AutoTokenizer

    from rlproxy.serving.choice_text import token_bytes

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return frozenset(i for i in tok.get_vocab().values() if is_number_token(token_bytes(tok, i)))


@functools.cache
def end_token_ids(model_dir: Path) -> frozenset[int]:
    """The ids that end a reply, as mlx-lm reads them: generation_config.json's eos_token_id
    (SmolLM2 lists two), else the tokenizer's end token."""
    config = Path(model_dir) / "generation_config.json"
    if not config.exists():
        from transformers import AutoTokenizer

        return frozenset([AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id])
    eos = json.loads(config.read_text())["eos_token_id"]
    return frozenset(eos if isinstance(eos, list) else [eos])


# Whose token ids digit_reward reads. A reward function is handed the turn alone (token ids, no
# model), so the demo names the model it serves while it runs (`scoring_tokens`); outside it,
# the generated tiny model's (the tiny and small models share one tokenizer).
_scored_model_dir: Path | None = None


@contextlib.contextmanager
def scoring_tokens(model_dir: Path):
    """digit_reward reads MODEL_DIR's token ids inside this block."""
    global _scored_model_dir
    before, _scored_model_dir = _scored_model_dir, Path(model_dir)
    number_token_ids(_scored_model_dir), end_token_ids(_scored_model_dir)  # loaded once, now
    try:
        yield
    finally:
        _scored_model_dir = before


def scored_model_dir() -> Path:
    from rlproxy.serving.embedded_model import embedded_model_path

    return _scored_model_dir or embedded_model_path("tiny")


def digit_reward(turn: dict, next_state: list[dict] | None) -> float:
    """Reward function for the scorer (`--reward-function rlproxy.demo:digit_reward`): the share
    of the reply's tokens that are numbers, in [-1, 1]. The end token is not part of the reply."""
    choice = turn["choices"][turn.get("chosen_choice", 0)]
    model_dir = scored_model_dir()
    targets, ends = number_token_ids(model_dir), end_token_ids(model_dir)
    return share_reward([t in targets for t in choice["completion_ids"] if t not in ends])


# ---- the scripted agent ----

def weather(rng: random.Random, city: str) -> str:
    return json.dumps({"city": city, "temperature_c": rng.randint(-5, 35),
                       "humidity_pct": rng.randint(20, 95), "wind_kmh": rng.randint(0, 60)})


def opening(rng: random.Random) -> list[dict]:
    """The first request's history: the user asked, the agent called the tool, it answered."""
    city = rng.choice(CITIES)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"How warm is it in {city} right now, and how windy?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": weather(rng, city)}]


async def chat(http: ClientSession, messages: list[dict], headers: dict, **params) -> dict:
    body = {"model": "rlproxy", "messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS,
            "temperature": 1.0, **params}
    async with http.post("/v1/chat/completions", json=body, headers=headers) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"rlproxy answered {r.status}: {answer}")
        return answer["choices"][0]


async def run_session(http: ClientSession, sid: str, seed: int) -> None:
    """Two model turns: the answer to the tool result, then the answer to a follow-up."""
    rng = random.Random(seed)
    messages = opening(rng)
    for step, last in ((0, False), (1, True)):
        headers = {"X-Session-Id": sid, **({"X-Session-Done": "1"} if last else {})}
        reply = (await chat(http, messages, headers, seed=seed * 2 + step))["message"]
        said = {"role": "assistant", "content": reply["content"] or ""}
        if reply.get("tool_calls"):
            said["tool_calls"] = reply["tool_calls"]
        messages = messages + [said, {"role": "user",
                                      "content": "Thanks. What will it be tomorrow?"}]


async def measure(http: ClientSession, seed: int) -> list[tuple[float, str]]:
    """(reward, text) of EVAL_SAMPLES fresh replies, opted out of recording and training. The
    same seeds every time, so two measurements differ by the policy, not by the dice."""
    async def one(i: int) -> tuple[float, str]:
        choice = await chat(http, opening(random.Random(seed + i)), {"X-RL-Opt-Out": "1"},
                            seed=seed + i, logprobs=True)
        tokens = (choice.get("logprobs") or {}).get("content") or []
        reward = share_reward([is_number_token(bytes(t["bytes"])) for t in tokens])
        return reward, choice["message"]["content"] or ""

    # One first, alone: the others then find its system prompt and tools in the prefix cache
    # instead of all prefilling them at once (on SmolLM2, most of the first measurement's time).
    first = await one(0)
    return [first] + list(await asyncio.gather(*(one(i) for i in range(1, EVAL_SAMPLES))))


# ---- the run ----

def learning_rate(args) -> float:
    return demo_guard.GUARD_LEARNING_RATE if args.guard else recipe(args.model).learning_rate


def demo_settings(args, data_dir: Path):
    return load_settings({
        "data_dir": str(data_dir), "model": args.model,
        "judge": False,  # the reward function is the reward
        "at_least_one": False,  # it would lift every all-negative session to +1
        "reward_functions": [REWARD_FUNCTION], "train": True, "resume": False,
        "batch_size": BATCH_SIZE, "learning_rate": learning_rate(args),
        "save_interval": args.steps, "fsync": False,  # one checkpoint: the final adapter
        **(demo_guard.guard_flags(data_dir.parent, opening) if args.guard else {}),
    }, environ={})


async def health(http: ClientSession) -> dict:
    async with http.get("/healthz") as r:
        return await r.json()


class Paused(Exception):
    """The eval gate paused training (too many rollbacks in a row): the guarded run ends."""


async def wait_until(http: ClientSession, ok, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = await health(http)
        error = h["trainer"].get("error") or h["error"]
        if error and error.startswith("training paused"):
            raise Paused(error)
        if error:
            raise RuntimeError(f"rlproxy failed: {error}")
        if ok(h):
            return h
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not catch up in {timeout_s:.0f} s: {h['trainer']}")
        await asyncio.sleep(0.2)


def mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))


async def demo(args, out: Path) -> dict:
    from rlproxy.app import create_app

    settings = demo_settings(args, out / "data")
    runner = web.AppRunner(create_app(settings))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        print(f"dashboard (while the demo runs): {url}/ui", flush=True)
        # trust_env stays off: no proxy variable may send this loopback traffic elsewhere
        async with ClientSession(url, timeout=ClientTimeout(total=300)) as http:
            return await drive(args, http, out / "data")
    finally:
        await runner.cleanup()


async def drive(args, http: ClientSession, data: Path) -> dict:
    every = max(1, round(args.steps / 6))
    curve, started, news, paused = [], time.monotonic(), demo_guard.GateNews(data), None

    async def evaluate() -> int:
        h = await health(http)
        version, step = h["adapter_version"], h["trainer"]["step"]
        samples = await measure(http, seed=10_000)
        rewards = [r for r, _ in samples]
        m, sd = mean_sd(rewards)
        curve.append({"step": step, "adapter_version": version, "mean_reward": round(m, 4),
                      "sd": round(sd, 4), "n": len(rewards), "rewards": rewards,
                      "example": samples[0][1], "elapsed_s": round(time.monotonic() - started, 1)})
        progress.write(f"step {step:3d}  adapter v{version:<3d}  reward on {len(rewards)} "
                       f"fresh samples {m:+.3f} (sd {sd:.2f})  "
                       f"[{time.monotonic() - started:5.1f} s]")
        return version

    def report() -> None:  # the gate's evaluations and rollbacks since the last call
        for line in news.new():
            progress.write(demo_guard.describe(line))

    await evaluate()
    sessions, next_eval = 0, every
    steps = progress.bar(total=args.steps, desc="PPO steps", unit="step")
    try:
        while sessions * 2 < args.steps * BATCH_SIZE:
            # Each round samples from the newest adapter once the trainer has caught up (and,
            # with the gate, judged it): on-policy, so PPO's ratio starts at 1 and clipping does
            # not eat the signal. Measured with one batch of lag instead: 30 steps ended at
            # +0.04..+0.85 (3 runs), on-policy at +0.79..+0.99 (8).
            made = sessions * 2
            await wait_until(http, lambda h: h["trainer"]["turns_trained"]
                             + h["trainer"]["skipped"] >= made
                             and h["trainer"]["unevaluated_steps"] < demo_guard.EVAL_EVERY)
            report()
            await asyncio.gather(*(run_session(http, f"demo-{sessions + i:05d}", sessions + i)
                                   for i in range(AGENTS)))
            sessions += AGENTS
            # optimizer steps: with the gate, versions jump and rollbacks publish nothing
            n = (await health(http))["trainer"]["optimizer_steps"]
            steps.update(min(args.steps, n) - steps.n)
            if next_eval <= n < args.steps:
                await evaluate()
                next_eval = n + every
        # all steps taken and, with the gate, the last one evaluated
        await wait_until(http, lambda h: h["trainer"]["optimizer_steps"] >= args.steps
                         and h["trainer"]["unevaluated_steps"] < demo_guard.EVAL_EVERY)
    except Paused as e:
        paused = str(e)
    report()
    if paused:
        progress.write(paused)
    steps.update(args.steps - steps.n)
    steps.close()
    await evaluate()
    return {"steps": args.steps, "sessions": sessions, "turns": sessions * 2,
            "batch_size": BATCH_SIZE, "learning_rate": learning_rate(args),
            "guard": args.guard, "paused": paused,
            "optimizer_steps": (await health(http))["trainer"]["optimizer_steps"],
            "eval_samples": EVAL_SAMPLES, "max_tokens": MAX_TOKENS,
            "reward": "2 * share of reply tokens that are numbers - 1 (rlproxy.demo:digit_reward)",
            "curve": curve, "elapsed_s": round(time.monotonic() - started, 1)}


def training_rewards(data_dir: Path, by_step: bool = False) -> list[tuple[int, float]]:
    """(adapter version that sampled them, mean reward) of each step's turns, from training.jsonl.
    The demo is on-policy: step k trains on turns sampled by version k - 1. BY_STEP: (the
    step's number, mean reward) instead (with the gate, turns are sampled by the served
    adapter, not by the previous step's)."""
    from rlproxy.paths import TRAINING
    from rlproxy.records import read_jsonl

    return [(line["step"] if by_step else line["adapter_version"] - 1, line["reward_mean"])
            for line in read_jsonl(data_dir / TRAINING)
            if line.get("kind") == "step" and line.get("reward_mean") is not None]


def svg_chart(series: list[tuple[str, str, list[tuple[float, float]]]], title: str,
              marks: list[tuple[float, str]] = (),
              xlabel: str = "PPO steps (adapter version)") -> str:
    """A self-contained line chart: reward (-1..1) against adapter version (or XLABEL), with a
    dashed red vertical line and its label at each of MARKS (x, label): the rollbacks."""
    w, h, left, right, top, bottom = 640, 360, 56, 16, 36, 44
    xmax = max([x for _, _, pts in series for x, _ in pts] + [x for x, _ in marks] + [1])

    def X(x: float) -> float:
        return left + (w - left - right) * x / xmax

    def Y(y: float) -> float:
        return top + (h - top - bottom) * (1 - y) / 2

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">'
           f'{escape(title)}</text>']
    for y in (-1, -0.5, 0, 0.5, 1):
        out.append(f'<line x1="{left}" y1="{Y(y):.1f}" x2="{w - right}" y2="{Y(y):.1f}" '
                   f'stroke="#ddd"/><text x="{left - 6}" y="{Y(y) + 4:.1f}" '
                   f'text-anchor="end">{y:g}</text>')
    for x in range(0, math.ceil(xmax) + 1, max(1, math.ceil(xmax / 6))):
        out.append(f'<text x="{X(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 8}" text-anchor="middle">'
               f'{escape(xlabel)}</text>')
    for x, label in marks:
        out.append(f'<line class="rollback" x1="{X(x):.1f}" y1="{top}" x2="{X(x):.1f}" '
                   f'y2="{h - bottom}" stroke="#d62728" stroke-dasharray="4 3"/>'
                   f'<text x="{X(x) + 3:.1f}" y="{top + 12}" fill="#d62728" font-size="10">'
                   f'{escape(label)}</text>')
    out.append(f'<text x="14" y="{(top + h - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top + h - bottom) / 2})">reward</text>')
    for k, (label, color, pts) in enumerate(series):
        if pts:
            path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       f'stroke-width="2"/>')
            out += [f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{color}"/>'
                    for x, y in pts if len(pts) < 40]
        out.append(f'<rect x="{left + 10}" y="{top + 8 + 18 * k}" width="12" height="3" '
                   f'fill="{color}"/><text x="{left + 28}" y="{top + 13 + 18 * k}">'
                   f'{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def run_demo(args) -> int:
    from rlproxy.serving.model import resolve_source

    if args.steps is None:  # not given: the model's own default
        args = argparse.Namespace(**{**vars(args), "steps": recipe(args.model).steps})
    if args.steps < 1:
        print(f"rlproxy demo: --steps must be at least 1, not {args.steps}", file=sys.stderr)
        return 2
    out = Path(args.out)
    data = out / "data"
    shutil.rmtree(data, ignore_errors=True)  # the demo's own records: every run starts fresh
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_source(args.model)  # fetched and converted on first use, then cached
    print(f"rlproxy demo: serving {source.model_id} ({source.origin})", flush=True)
    print(f"rlproxy demo: {args.steps} PPO steps of {BATCH_SIZE} turns, learning rate "
          f"{learning_rate(args):g}{' (too high on purpose), eval gate on' if args.guard else ''}"
          f"; reward = share of reply tokens that are numbers, mapped to [-1, 1]", flush=True)
    with scoring_tokens(Path(source.path)):  # the served model's tokenizer, not tiny's
        result = asyncio.run(demo(args, out))
    curve = result["curve"]
    trained = training_rewards(data, by_step=args.guard)
    result["training"] = [{"step" if args.guard else "sampled_by_version": v, "reward_mean": r}
                          for v, r in trained]
    series = [("fresh samples (opted out, never trained)", "#1f77b4",
               [(c["step" if args.guard else "adapter_version"], c["mean_reward"])
                for c in curve]),
              ("the turns each step trained on", "#ff7f0e", trained)]
    marks, xlabel = [], "PPO steps (adapter version)"
    if args.guard:  # x: the trainer's step (versions jump; a rollback takes a step)
        result["gate"] = demo_guard.gate_summary(data)
        series.append(demo_guard.probe_series(result["gate"]))
        marks = [(r["step"], "rollback") for r in result["gate"]["rollbacks"]]
        xlabel = "optimizer steps (a rollback takes one)"
    (out / "curve.json").write_text(json.dumps(result, indent=2))
    first, last = curve[0], curve[-1]
    (out / "curve.svg").write_text(svg_chart(
        series, f"rlproxy demo: reward {first['mean_reward']:+.2f} -> {last['mean_reward']:+.2f}",
        marks, xlabel))
    # The same seeds are measured each time, so the paired difference has a small error.
    diffs = [b - a for a, b in zip(first["rewards"], last["rewards"])]
    gain, sd = mean_sd(diffs)
    se = sd / math.sqrt(len(diffs))
    if args.guard:
        print(demo_guard.summary(result["gate"]))
    print(f"reward {first['mean_reward']:.2f} -> {last['mean_reward']:.2f} over "
          f"{result['optimizer_steps']} PPO steps (adapter v{last['adapter_version']}); gain "
          f"{gain:+.2f} +- {2 * se:.2f} (2 s.e., paired over {len(diffs)} seeds); "
          f"{result['elapsed_s']:.0f} s", flush=True)
    for point in (first, last):
        print(f"  a reply at v{point['adapter_version']}: {point['example'][:70]!r}")
    print(f"chart: {out / 'curve.svg'}  curve: {out / 'curve.json'}  records: {data}")
    adapter = latest_checkpoint(data / paths.CHECKPOINTS)
    if adapter is not None:
        print(f"adapter: {adapter}  (rlproxy serve --adapter {adapter})", flush=True)
    return 0
