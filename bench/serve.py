"""Serving benchmark: what the proxy costs over mlx-lm, and what batching buys.

Runs, in one process on one machine, against the embedded model:

1. Proxy overhead: a non-streaming greedy chat completion through the real aiohttp app over HTTP
   on 127.0.0.1, versus mlx-lm's own `stream_generate` in-process on the same prompt token ids
   for the same number of tokens. Warm-up, then alternated A B A B ...; medians and their ratio.
2. Batching: aggregate completion tokens/s of 8 concurrent requests (8 seeds, temperature 1)
   versus one request alone, over the same HTTP API; medians of a few rounds and their ratio.
   Twice: with the agent prompt (8 prefills weigh in) and with the user message alone (decode).

Prints one line per figure and writes everything to a JSON file. It measures; it changes nothing
in rlproxy.

    python bench/serve.py [--size tiny|small] [--max-tokens 128] [--out bench/results/serve.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import aiohttp
import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from common import environment, report, start_server
from rlproxy.serving.model import LoadedModel, load_serving_model
from rlproxy.settings import load_settings

OVERHEAD_GOAL = 1.05  # proxy time / in-process time, at most
BATCHING_GOAL = 3.0  # 8 concurrent requests' tok/s / one request's tok/s, at least
CONCURRENCY = 8

# An agent-shaped prompt: a system prompt of a few hundred tokens, then a user request.
SYSTEM_PROMPT = """\
You are Hermes, an autonomous software engineering agent running inside a developer's terminal.
You help the user read, write, test and debug code in their repository. You have access to a
shell, a file editor and a web search tool; call them whenever they help, and prefer reading the
code over guessing. Work in small, verifiable steps.

# Guidelines
- Before editing a file, read the parts of it you are about to change, and keep the style of the
  surrounding code: naming, comments, error handling and formatting.
- Run the project's tests after every change that could break them. If a test fails, read the
  failure carefully, find the cause, and fix the cause rather than the symptom.
- Never delete files, rewrite history or push to a remote unless the user asks for it explicitly.
- When a command takes a long time, say what you are waiting for. When it fails, show the
  relevant lines of its output, not all of it.
- Keep answers short. Use Markdown for code blocks and lists. Quote file paths and line numbers so
  the user can follow along in their editor.
- If the request is ambiguous, ask one clarifying question before starting work that is hard to
  undo. Otherwise, make a reasonable choice and say which one you made.
- Respect the user's time: summarise what you changed and why at the end of every task, and list
  anything you left undone or found suspicious along the way.

# Environment
Operating system: Linux (Debian 12), shell: bash, Python 3.11, Node 20.
Current working directory: /home/user/projects/inventory-service
The repository is a Python web service with a PostgreSQL database, an HTTP API built on aiohttp,
a test suite under tests/ run with pytest, and a Makefile with targets for lint, test and run.
Today's date is 2025-06-14.
"""

USER_MESSAGE = (
    "The endpoint GET /items?page=2 returns the same items as page 1. Find out why, fix it, "
    "and add a test that would have caught it."
)


def agent_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_MESSAGE}]


def short_messages() -> list[dict]:
    return [{"role": "user", "content": USER_MESSAGE}]


# ---- the in-process baseline: mlx-lm alone ----


def mlx_lm_generate(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int):
    """Greedy generation with mlx-lm's own loop: (seconds, token ids incl. a final EOS, text)."""
    tic = time.perf_counter()
    tokens, text = [], ""
    for r in stream_generate(loaded.model, loaded.tokenizer, mx.array(prompt_ids),
                             max_tokens=max_tokens, sampler=make_sampler(temp=0.0)):
        tokens.append(r.token)
        text += r.text
    return time.perf_counter() - tic, tokens, text


# ---- the proxy over HTTP ----


async def chat(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, dict]:
    tic = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
    seconds = time.perf_counter() - tic
    if resp.status != 200:
        raise RuntimeError(f"proxy answered {resp.status}: {data}")
    return seconds, data


def chat_body(messages: list[dict], max_tokens: int, temperature: float,
              seed: int | None = None) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": False}
    if seed is not None:
        body["seed"] = seed
    return body


# ---- the two measurements ----


async def settle() -> None:
    # Let the engine thread finish any step still in flight so the next timing runs alone.
    await asyncio.sleep(0.05)


async def measure_overhead(http, url: str, loaded: LoadedModel, max_tokens: int,
                           repeats: int, warmup: int) -> dict:
    prompt_ids = list(loaded.tokenizer.apply_chat_template(agent_messages(),
                                                           add_generation_prompt=True))
    body = chat_body(agent_messages(), max_tokens, temperature=0.0)
    # The in-process call runs on this (the event loop's) thread while no request is in flight,
    # so the engine thread is idle and the two never run the shared model at once.
    for _ in range(warmup):
        await chat(http, url, body)
        await settle()
        mlx_lm_generate(loaded, prompt_ids, max_tokens)
        await settle()
    proxy_s, local_s, runs = [], [], []
    for _ in range(repeats):
        p_s, data = await chat(http, url, body)
        await settle()
        l_s, tokens, text = mlx_lm_generate(loaded, prompt_ids, max_tokens)
        await settle()
        usage = data["usage"]
        proxy_s.append(p_s)
        local_s.append(l_s)
        runs.append({"proxy_s": p_s, "in_process_s": l_s,
                     "proxy_prompt_tokens": usage["prompt_tokens"],
                     "proxy_completion_tokens": usage["completion_tokens"],
                     "in_process_prompt_tokens": len(prompt_ids),
                     "in_process_completion_tokens": len(tokens),
                     "proxy_finish_reason": data["choices"][0]["finish_reason"],
                     "same_text": data["choices"][0]["message"]["content"] == text})
    if any(r["proxy_completion_tokens"] != r["in_process_completion_tokens"]
           or r["proxy_prompt_tokens"] != r["in_process_prompt_tokens"] for r in runs):
        raise RuntimeError("proxy and mlx-lm did not process the same numbers of tokens; "
                           f"the comparison would be unfair: {runs}")
    proxy, local = statistics.median(proxy_s), statistics.median(local_s)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": runs[0]["proxy_completion_tokens"],
        "same_text_all_runs": all(r["same_text"] for r in runs),
        "proxy_median_s": proxy,
        "in_process_median_s": local,
        "proxy_min_s": min(proxy_s),
        "in_process_min_s": min(local_s),
        "ratio": proxy / local,
        # Each pair ran back to back, so its ratio is less exposed to the machine's drift.
        "paired_ratio_median": statistics.median(p / q for p, q in zip(proxy_s, local_s)),
        "overhead_ms_per_token": (proxy - local) * 1000 / runs[0]["proxy_completion_tokens"],
        "goal_ratio_at_most": OVERHEAD_GOAL,
        "met": proxy / local <= OVERHEAD_GOAL,
        "runs": runs,
    }


async def timed_batch(http, url: str, messages: list[dict], max_tokens: int,
                      seeds: list[int]) -> dict:
    tic = time.perf_counter()
    results = await asyncio.gather(
        *(chat(http, url, chat_body(messages, max_tokens, temperature=1.0, seed=s))
          for s in seeds))
    seconds = time.perf_counter() - tic
    tokens = sum(data["usage"]["completion_tokens"] for _, data in results)
    return {"requests": len(seeds), "seconds": seconds, "completion_tokens": tokens,
            "tok_per_s": tokens / seconds,
            "prompt_tokens_each": results[0][1]["usage"]["prompt_tokens"],
            "finish_reasons": [data["choices"][0]["finish_reason"] for _, data in results]}


async def measure_batching(http, url: str, messages: list[dict], max_tokens: int,
                           repeats: int) -> dict:
    seeds = list(range(1, CONCURRENCY + 1))
    await timed_batch(http, url, messages, max_tokens, seeds[:1])  # warm-up, both shapes
    await timed_batch(http, url, messages, max_tokens, seeds)
    single, batched = [], []
    for _ in range(repeats):  # alternated, so drift hits both alike
        await settle()
        single.append(await timed_batch(http, url, messages, max_tokens, seeds[:1]))
        await settle()
        batched.append(await timed_batch(http, url, messages, max_tokens, seeds))
    one = statistics.median(r["tok_per_s"] for r in single)
    many = statistics.median(r["tok_per_s"] for r in batched)
    return {
        "prompt_tokens_each": single[0]["prompt_tokens_each"],
        "concurrency": CONCURRENCY,
        "single_tok_per_s_median": one,
        "concurrent_tok_per_s_median": many,
        "ratio": many / one,
        "goal_ratio_at_least": BATCHING_GOAL,
        "met": many / one >= BATCHING_GOAL,
        "single_runs": single,
        "concurrent_runs": batched,
    }


# ---- report ----


def summary_lines(result: dict) -> list[str]:
    o = result["overhead"]
    verdict = {True: "met", False: "NOT met"}
    load = result["machine"]["load_average_1m"]
    lines = [
        f"machine: {result['machine']['cpus']} CPUs, 1-min load average {load['before']:.2f} "
        f"before, {load['after']:.2f} after (other processes on the CPUs skew every figure)",
        f"model: embedded {result['size']} ({result['model_id']}), BLAS: {result['blas']}, "
        f"mlx {result['mlx_version']}, mlx-lm {result['mlx_lm_version']}",
        f"prompt: {o['prompt_tokens']} tokens; completion: {o['completion_tokens']} tokens "
        f"(proxy and in-process alike; same text in every run: {o['same_text_all_runs']})",
        f"proxy overhead: proxy {o['proxy_median_s'] * 1000:.1f} ms vs mlx-lm in-process "
        f"{o['in_process_median_s'] * 1000:.1f} ms (median of {len(o['runs'])}) -> "
        f"{o['ratio']:.3f}x, {o['overhead_ms_per_token']:+.2f} ms/token; paired ratios' median "
        f"{o['paired_ratio_median']:.3f}x (goal <= {OVERHEAD_GOAL}x: {verdict[o['met']]})",
    ]
    for name, b in result["batching"].items():
        lines.append(
            f"batching, {name} prompt ({b['prompt_tokens_each']} tokens): {CONCURRENCY} concurrent "
            f"{b['concurrent_tok_per_s_median']:.0f} tok/s vs 1 alone "
            f"{b['single_tok_per_s_median']:.0f} tok/s (median of {len(b['single_runs'])}) -> "
            f"{b['ratio']:.2f}x (goal >= {BATCHING_GOAL}x: {verdict[b['met']]})")
    return lines


async def run(args: argparse.Namespace) -> dict:
    # environ={}: the benchmark must not pick up a user's RLPROXY_API_KEY or the like.
    load_before = os.getloadavg()[0]
    settings = load_settings({"model": args.size}, environ={})
    loaded = load_serving_model(settings.model)
    runner, url = await start_server(settings, loaded)
    try:
        async with aiohttp.ClientSession() as http:
            overhead = await measure_overhead(http, url, loaded, args.max_tokens,
                                              args.repeats, args.warmup)
            batching = {
                name: await measure_batching(http, url, messages, args.max_tokens,
                                             args.batch_repeats)
                for name, messages in [("agent", agent_messages()), ("short", short_messages())]
            }
    finally:
        await runner.cleanup()  # stops the engine thread before the interpreter exits
    return {
        **environment(args.size, load_before, loaded.model_id, settings.model_dump(mode="json")),
        "max_tokens": args.max_tokens,
        "overhead": overhead,
        "batching": batching,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="overhead: timed A/B pairs")
    parser.add_argument("--warmup", type=int, default=2, help="overhead: untimed A/B pairs")
    parser.add_argument("--batch-repeats", type=int, default=3, help="batching: timed rounds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
