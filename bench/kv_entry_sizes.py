"""What an agent-length prefix-cache entry costs on disk, in first-token time and in log-prob
drift, stored in full precision, 8-bit or 4-bit (`--kv-bits`), on a real model.

    python bench/kv_entry_sizes.py [--model smollm2-135m-instruct] [--tokens 16000]
        [--out bench/results/kv_entry_sizes.json]

An agent-shaped prompt (bench/agent_workload.py's Hermes-like system prompt and 20 tool schemas,
then a conversation of tool calls and results, through the model's chat template) is cut to
--tokens and prefilled once, in 2,048-token chunks as the engine does (the cold first-token
time). Its KV goes through the real store (kv/prefix_cache.py: quantized as --kv-bits says,
packed, CRC'd, written with diskcache) with no memory tier, so the lookup of the prompt plus a
new ~200-token user message reads the entry back from disk, checks it, unpacks and dequantizes
it (the restore). Then the suffix is prefilled and 32 tokens decoded greedily on the exact KV,
and the same tokens teacher-forced on the restored KV: the drift is the difference of their
log-probs (the sampled token's, and KL over the whole distribution). Prints one line per
variant and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import rlproxy  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_workload import SYSTEM_PROMPT, TOOLS, tool_call, tool_result  # noqa: E402

from rlproxy.kv.blobs import adapter_fingerprint, default_group_size, model_key  # noqa: E402
from rlproxy.kv.prefix_cache import PrefixCache  # noqa: E402
from rlproxy.serving.chat_template import render_prompt  # noqa: E402
from rlproxy.serving.model import load_serving_model  # noqa: E402
from rlproxy.settings import CacheSettings, ModelSettings  # noqa: E402

CHUNK = 2048
DECODE = 32


def agent_prompt(tokenizer, tokens: int) -> tuple[list[int], list[int]]:
    """(the conversation's ids cut to TOKENS, a next user message's ids after them)."""
    rng = random.Random(0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Fix the failing tests in the billing module."}]
    step = 0
    while len(render_prompt(tokenizer, messages, TOOLS)) < tokens + 400:
        call = tool_call(step, f"call_{step}", rng)
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{step}",
                      "content": tool_result(step, rng)}]
        step += 1
    ids = render_prompt(tokenizer, messages, TOOLS)[:tokens]
    suffix = tokenizer.encode(" Now also run the linter on the files you changed and fix what "
                              "it reports; then summarise every change in three lines. " * 6,
                              add_special_tokens=False)[:200]
    return ids, suffix


def prefill(model, cache, ids: list[int]) -> mx.array:
    """Run IDS through the model into CACHE in engine-sized chunks; the last position's logits."""
    for i in range(0, len(ids), CHUNK):
        logits = model(mx.array([ids[i:i + CHUNK]]), cache=cache)
        mx.eval([c.state for c in cache], logits)
    return logits[0, -1]


def greedy(model, cache, first: mx.array, n: int) -> tuple[list[int], list[mx.array]]:
    """N greedy tokens from logits FIRST on; each step's log-probs."""
    tokens, lps, logits = [], [], first
    for _ in range(n):
        lp = logits - mx.logsumexp(logits)
        tok = int(mx.argmax(lp).item())
        tokens.append(tok)
        lps.append(lp)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        mx.eval(logits)
    return tokens, lps


def forced(model, cache, first: mx.array, tokens: list[int]) -> list[mx.array]:
    lps, logits = [], first
    for tok in tokens:
        lps.append(logits - mx.logsumexp(logits))
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        mx.eval(logits)
    return lps


def store_for(loaded, bits: int | None, directory: Path) -> PrefixCache:
    """The real store, without a memory tier (a lookup reads the entry from disk)."""
    settings = CacheSettings(kv_bits=bits, kv_group_size=default_group_size(loaded.model),
                             quantized_kv_start=0, prefix_cache_memory_mb=0,
                             prefix_cache_disk_limit_gb=64)
    store = PrefixCache(directory, settings, model_key(loaded.model, loaded.model_id))
    store.set_adapter(0, adapter_fingerprint(loaded.model))
    return store


def write(store: PrefixCache, ids: list[int], cache: list) -> float:
    """Store the KV of IDS; the seconds until it is on disk."""
    tic = time.perf_counter()
    store.put(ids, cache, [len(ids)], store.served())
    store._queue.join()  # written, and out of the queued writes lookups also read
    return time.perf_counter() - tic


def variant(loaded, store, ids, suffix, exact_tokens, exact_lps, write_s) -> dict:
    """Restore the entry for IDS + SUFFIX from disk, prefill SUFFIX on it, teacher-force the
    exact run's tokens: sizes, times and drift."""
    health = store.health()
    tic = time.perf_counter()
    restored, n, _ = store.fetch(ids + suffix)
    mx.eval([c.state for c in restored])
    restore_s = time.perf_counter() - tic
    assert n == len(ids) and store.stats.disk_hits == 1, (n, store.stats)
    first = prefill(loaded.model, restored, suffix)
    ttft_s = time.perf_counter() - tic
    lps = forced(loaded.model, restored, first, exact_tokens)
    picked = [abs(float(a[t] - b[t])) for a, b, t in zip(exact_lps, lps, exact_tokens)]
    kls = [float((mx.exp(a) * (a - b)).sum()) for a, b in zip(exact_lps, lps)]
    same = sum(int(mx.argmax(b).item()) == t for b, t in zip(lps, exact_tokens))
    quant = health["kv_quantization"]["stored_entries"]
    return {"kv_bits": quant and quant["bits"], "entry_bytes": health["bytes_written"],
            "bytes_per_token": round(health["bytes_written"] / len(ids), 1),
            "disk_bytes": health["disk_bytes"], "write_s": round(write_s, 3),
            "restore_s": round(restore_s, 3), "hit_ttft_s": round(ttft_s, 3),
            "logprob_abs_diff_mean": sum(picked) / len(picked),
            "logprob_abs_diff_max": max(picked), "kl_mean": sum(kls) / len(kls),
            "kl_max": max(kls), "greedy_agree": f"{same}/{len(exact_tokens)}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=16000)
    p.add_argument("--bits", type=int, nargs="+", default=[0, 8, 4])
    p.add_argument("--out", default="bench/results/kv_entry_sizes.json")
    args = p.parse_args(argv)
    window = max(32768, 1 << (args.tokens + 1024).bit_length())
    loaded = load_serving_model(ModelSettings(model=args.model, context_length=window))
    ids, suffix = agent_prompt(loaded.tokenizer, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        stores = {bits: store_for(loaded, bits or None, Path(tmp) / str(bits))
                  for bits in args.bits}
        try:
            cache = make_prompt_cache(loaded.model)
            tic = time.perf_counter()
            prefill(loaded.model, cache, ids)
            prompt_s = time.perf_counter() - tic
            writes = {bits: write(store, ids, cache) for bits, store in stores.items()}
            tic = time.perf_counter()
            first = prefill(loaded.model, cache, suffix)  # the exact run: no store between
            cold_s = prompt_s + time.perf_counter() - tic
            tokens, lps = greedy(loaded.model, cache, first, DECODE)
            del cache
            result = {"model": loaded.model_id, "prompt_tokens": len(ids),
                      "suffix_tokens": len(suffix), "cold_ttft_s": round(cold_s, 3),
                      "variants": []}
            print(f"{loaded.model_id}: {len(ids):,}-token entry + {len(suffix)}-token suffix; "
                  f"first token without the cache {cold_s:.1f} s", flush=True)
            for bits, store in stores.items():
                v = variant(loaded, store, ids, suffix, tokens, lps, writes[bits])
                result["variants"].append(v)
                print(f"  kv_bits {bits or 'none':>4}: {v['entry_bytes'] / 1e6:7.1f} MB "
                      f"({v['bytes_per_token']:,.0f} B/token), written in {v['write_s']:.2f} s;"
                      f" restore {v['restore_s']:.2f} s, first token on a hit "
                      f"{v['hit_ttft_s']:.2f} s; |dlogp| mean {v['logprob_abs_diff_mean']:.4f} "
                      f"max {v['logprob_abs_diff_max']:.4f}, KL mean {v['kl_mean']:.2e}; "
                      f"greedy {v['greedy_agree']}", flush=True)
        finally:
            for store in stores.values():
                store.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
