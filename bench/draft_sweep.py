"""How long prompt-lookup drafts should be (rlproxy/serving/speculate.py's DRAFT_MAX, and
NGRAM_MIN): a lone greedy stream decoded through `LoneStream` with each draft policy, on
bench/vs_peers.py's agent-output prompts.

A policy is a draft length (`0`: no draft, one token a forward pass, the lone stream's own
baseline; `6`: every step drafts up to 6), and `:nK` after it looks up suffixes down to K
tokens long (`6:n1`; default speculate.NGRAM_MIN). After a warm-up of each policy, each prompt
is prefilled once per policy and round (not timed); the figure is decode tokens/s after the
first token, policies alternated round by round, median over rounds; also tokens a step and the
share of drafted tokens accepted. Greedy text must be the same under every policy (asserted):
drafts change only how many tokens a step yields.

    python bench/draft_sweep.py [--model smollm2-135m-instruct] [--kinds tool edit summary plain]
        [--policies 0 6 10 16] [--rounds 2] [--max-tokens 128] [--dequantize no]
        [--out bench/results/draft_sweep.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from common import environment, report
from rlproxy.serving import speculate
from rlproxy.serving.jobs import Job, SamplingParams
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings
from vs_peers import agent_text


def decode(model, prompt: list[int], policy: str, max_tokens: int) -> dict:
    """One greedy stream of MAX_TOKENS under POLICY: its tokens, decode seconds after the first
    token, forward passes and drafted / accepted tokens."""
    length, _, ngram_min = policy.partition(":n")
    saved = speculate.DRAFT_MAX, speculate.NGRAM_MIN
    speculate.DRAFT_MAX = int(length)  # read by LoneStream.step at each step
    if ngram_min:
        speculate.NGRAM_MIN = int(ngram_min)
    try:
        lone = speculate.LoneStream.start(
            model, Job(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                       lambda s: None), None, 0)
        ids = [e.token for e in lone.step(model)]  # the first token: never drafted
        steps = drafted = accepted = 0
        start = time.perf_counter()
        while lone.produced < max_tokens:
            ids += [e.token for e in lone.step(model)]
            steps += 1
            drafted, accepted = drafted + lone.last_drafted, accepted + lone.last_accepted
        seconds = time.perf_counter() - start
    finally:
        speculate.DRAFT_MAX, speculate.NGRAM_MIN = saved
    return {"ids": ids, "seconds": seconds, "steps": steps, "drafted": drafted,
            "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dequantize", default="auto", choices=["auto", "yes", "no"],
                    help="as `rlproxy serve --dequantize` (no: SmolLM2's 4-bit weights as shipped)")
    ap.add_argument("--kinds", nargs="+", default=["tool", "edit", "summary", "plain"])
    ap.add_argument("--policies", nargs="+", default=["0", "6", "10", "16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/draft_sweep.json")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    loaded = load_serving_model(ModelSettings(model=args.model, dequantize=args.dequantize))
    model, tok = loaded.model, loaded.tokenizer
    results, lines = {}, []
    for kind in args.kinds:
        prompt = tok.apply_chat_template([{"role": "user", "content": agent_text(kind, "a1")}],
                                         add_generation_prompt=True)
        runs: dict = {p: [] for p in args.policies}
        for policy in args.policies:  # warm-up, not counted: first calls of each shape
            decode(model, prompt, policy, 16)
        for _ in range(args.rounds):
            for policy in args.policies:  # alternated: drift in the machine hits them alike
                runs[policy].append(decode(model, prompt, policy, args.max_tokens))
                mx.clear_cache()
        texts = {p: r[0]["ids"] for p, r in runs.items()}
        assert len({tuple(t) for t in texts.values()}) == 1, f"{kind}: greedy text differs"
        base = statistics.median((len(r["ids"]) - 1) / r["seconds"]
                                 for r in runs[args.policies[0]])
        results[kind] = {"prompt_tokens": len(prompt)}
        for policy, rs in runs.items():
            tps = statistics.median((len(r["ids"]) - 1) / r["seconds"] for r in rs)
            steps, drafted, accepted = (sum(r[k] for r in rs) for k in ("steps", "drafted",
                                                                          "accepted"))
            results[kind][policy] = {
                "decode_tok_s": round(tps, 2), "vs_first_policy": round(tps / base, 3),
                "tokens_per_step": round(sum(len(r["ids"]) - 1 for r in rs) / steps, 2),
                "acceptance": round(accepted / drafted, 3) if drafted else None}
            lines.append(f"{kind:8s} {policy:>11s}: {tps:6.1f} tok/s decode "
                         f"({tps / base:.2f}x policy {args.policies[0]}), "
                         f"{results[kind][policy]['tokens_per_step']:.2f} tokens a step, "
                         f"acceptance {results[kind][policy]['acceptance']}")
            print(lines[-1], file=sys.stderr, flush=True)  # progress; all again at the end
    settings = {"rounds": args.rounds, "max_tokens": args.max_tokens,
                "dequantize": args.dequantize,
                "draft_max_served": speculate.DRAFT_MAX, "ngram": [speculate.NGRAM_MAX,
                                                                    speculate.NGRAM_MIN]}
    report(lines, environment(args.model, load_before, settings=settings) | {"results": results},
           Path(args.out))


if __name__ == "__main__":
    main()
