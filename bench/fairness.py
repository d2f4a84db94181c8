"""Head-of-line blocking: how long a short request waits while a long prompt prefills.

On the real engine thread and the embedded model (no HTTP, no prefix cache, so the long prompt
is prefilled from scratch every time): a 4-token request with a short chat prompt is timed
alone (`--reps` times, median), then a fresh `--chars`-character agent prompt (bench/
agent_workload.py's system prompt and tool schemas, as Hermes Agent sends on a first turn) is
submitted, and a short request arrives every `--every` seconds until that prompt's first token.
Reported: idle latency, latency during the long prefill (median and max), the bound of issue 13
(2x idle + the longest prefill chunk), the long prompt's time to first token, and the chunks.

    python bench/fairness.py [--size tiny] [--chars 30000] [--prefill-step-size 2048]
                             [--out bench/results/fairness.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from agent_workload import SYSTEM_PROMPT, TOOLS
from common import environment, report
from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import load_settings


def submit(engine: Engine, ids: list[int], max_tokens: int, no_end: dict) -> threading.Event:
    done = threading.Event()
    engine.submit(Job(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          logit_bias=no_end),
                      lambda step: step.finish_reason is not None and done.set()))
    return done


def timed(engine: Engine, ids: list[int], max_tokens: int, no_end: dict) -> float:
    tic = time.perf_counter()
    assert submit(engine, ids, max_tokens, no_end).wait(600)
    return time.perf_counter() - tic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--chars", type=int, default=30_000)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--every", type=float, default=0.5, help="seconds between short requests")
    p.add_argument("--out", type=Path, default=Path("bench/results/fairness.json"))
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    settings = load_settings({"model": args.size,
                              "prefill_step_size": args.prefill_step_size}, environ={})
    loaded = load_serving_model(settings.model)
    tok = loaded.tokenizer
    no_end = {t: -100.0 for t in tok.eos_token_ids}  # the short request makes exactly 4 tokens
    short = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                    add_generation_prompt=True)
    text = (SYSTEM_PROMPT + json.dumps(TOOLS))[:args.chars]
    long_ids = tok.apply_chat_template([{"role": "system", "content": text},
                                        {"role": "user", "content": "List the files."}],
                                       add_generation_prompt=True)
    engine = Engine(loaded.model, tok.eos_token_ids, prefill_step_size=args.prefill_step_size)
    engine.start()
    try:
        timed(engine, short, 4, no_end)  # warm-up
        idle = [timed(engine, short, 4, no_end) for _ in range(args.reps)]
        tic = time.perf_counter()
        long_done = submit(engine, long_ids, 1, no_end)
        during = []
        while not long_done.is_set():
            during.append(timed(engine, short, 4, no_end))
            long_done.wait(args.every)
        ttft = time.perf_counter() - tic
        stats = engine.health()
    finally:
        engine.stop()
    idle_s, chunk_s = statistics.median(idle), stats["max_prefill_chunk_ms"] / 1000
    bound = 2 * idle_s + chunk_s
    result = {
        **environment(args.size, load_before, loaded.model_id,
                      {"prefill_step_size": args.prefill_step_size, "chars": args.chars}),
        "long_prompt_tokens": len(long_ids), "short_prompt_tokens": len(short),
        "idle_s": idle, "during_s": during, "long_ttft_s": ttft,
        "prefill_chunks": stats["prefill_chunks"], "max_prefill_chunk_s": chunk_s,
        "bound_s": bound, "within_bound": max(during, default=0.0) <= bound,
    }
    lines = [
        f"long prompt: {len(long_ids)} tokens ({args.chars} characters), first token after "
        f"{ttft:.2f} s in {stats['prefill_chunks']} chunks (longest {chunk_s:.2f} s)",
        f"4-token request: idle {idle_s * 1000:.0f} ms (median of {args.reps}); during the "
        f"long prefill median {statistics.median(during) * 1000:.0f} ms, max "
        f"{max(during) * 1000:.0f} ms over {len(during)} requests",
        f"bound 2x idle + one chunk = {bound * 1000:.0f} ms: "
        f"{'met' if result['within_bound'] else 'NOT met'}",
    ]
    report(lines, result, args.out)


if __name__ == "__main__":
    main()
