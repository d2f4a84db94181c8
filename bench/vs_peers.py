"""rlproxy against other MLX servers, same model directory, same BLAS, alternating, one run.

Servers: rlproxy (`serve --no-train --no-judge`, its prefix cache on, as shipped),
`mlx_lm.server`, and where they are installed `vllm-mlx serve --continuous-batching` and
`mlx-openai-server launch`. Every server gets OpenBLAS: rlproxy preloads it, the peers through
LD_PRELOAD of the same library, so the figures compare servers, not BLAS builds.

Agent outputs (`--kinds tool edit summary plain`): the same prompts on each server, a fresh
identifier in each so no cache answers them, whose greedy answers copy from the prompt (tool
calls that quote listed paths, a file rewritten with one change, a file summarised function by
function) or copy nothing (`plain`, a story); `same text` says how many answers read the same as
rlproxy's. `--rlproxy-adapter` serves rlproxy a trained-like adapter (every lora_b drawn) against
the bare base on the peers; `--before-too` adds rlproxy as it was before both (`--speculate off
--no-merge-lora`) side by side.
After the rounds it prints rlproxy's speculation counters (acceptance, tokens per step).

Shapes: unique prompts (a distinct opening per request: no prompt cache can answer) and a
repeated prompt (the same text each time: fully cached after the first), of `--prompt-tokens`
tokens each (400 and 2,000), alone and `--concurrency` at once (1, 8, 16). Each request is a
streamed greedy chat completion of `--max-tokens` tokens; TTFT is the time to the first content
delta, tokens/s the round's completion tokens (usage, else deltas) over its wall time, request
the mean seconds from sending a request to its last byte (below 1: rlproxy's requests end
sooner on average, even where the round's last one ends later). For each
shape the servers take turns, `--rounds` times. It prints rlproxy / peer ratios (tokens/s above
1: rlproxy faster; TTFT below 1: rlproxy sooner) and writes JSON.

The peers install into a venv of their own beside this environment (they pin other mlx-lm
versions; their plain dependencies suffice):
    python3 -m venv --system-site-packages .peers
    .peers/bin/pip install --no-deps vllm-mlx==0.6.0 mlx-openai-server==1.8.1
    .peers/bin/pip install fastapi 'uvicorn<0.40' psutil tabulate jsonschema pytz loguru \\
        click json_repair 'xxhash<4' aiofiles python-multipart openai-harmony

    python bench/vs_peers.py [--peers-bin .peers/bin] [--model smollm2-135m-instruct]
        [--prompt-tokens 400 2000] [--concurrency 1 8 16] [--max-tokens 128] [--rounds 2]
        [--same-adapter | --rlproxy-adapter] [--kinds unique repeated tool edit summary plain]
        [--before-too]

By default the peers serve the bare base model while rlproxy serves it with its LoRA adapter
(every linear layer of every block, as shipped): rlproxy does more work per token. With
`--same-adapter`, the bench writes one adapter in mlx-lm's layout (rlproxy's default LoRA
layers, lora_b drawn as well, so every adapted projection changes like a trained one) and serves
it on rlproxy (`--adapter`) and on `mlx_lm.server` (`--adapter-path`): equal work. The other
peers take no mlx-lm adapter, so that mode runs `mlx_lm.server` alone against rlproxy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import requests

from vs_mlx_lm import start, stop_all, wait_ready  # noqa: I001  (bench/: the script dir)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rlproxy  # noqa: E402,F401  (preloads OpenBLAS)
from rlproxy.ops.served import free_port  # noqa: E402
from rlproxy.serving.blas import blas_in_use  # noqa: E402
from rlproxy.serving.model import resolve_source  # noqa: E402

PATHS = ["src/handlers/{}.py", "src/models/{}.py", "tests/test_{}.py", "docs/{}.md"]
NAMES = ["billing", "accounts", "search", "upload", "session", "report", "invoice", "audit",
         "export", "notify", "profile", "cache"]


def agent_text(kind: str, tag: str) -> str:
    """A prompt whose answer copies from it, as agents' outputs do; TAG makes it unique (no
    prompt cache answers it). `tool`: tool calls that quote paths listed in the prompt; `edit`:
    a file rewritten with one change; `summary`: a file summarised function by function;
    `plain`: prose that copies nothing."""
    names = [f"{n}_{tag}" for n in NAMES]
    code = "\n".join(f"def handle_{n}(request, store):\n    record = store.load('{n}', "
                     f"request.user_id)\n    return render('templates/{n}.html', record)\n"
                     for n in names)
    if kind == "tool":
        listing = "\n".join(p.format(n) for n in names for p in PATHS)
        return (f"Repository files:\n{listing}\n\nCall read_file on every file under "
                "src/handlers/, one call per line, written as read_file(path=\"...\").")
    if kind == "edit":
        return (f"Here is app/views.py:\n```python\n{code}```\nRewrite the whole file with "
                "`store.load` renamed to `store.fetch`. Output only the file.")
    if kind == "summary":
        return (f"Here is app/views.py:\n```python\n{code}```\nFor each function, give its "
                "name, the store key it loads and the template it renders.")
    return f"Write a long story about a lighthouse keeper named {tag}."


FILLER = ("The committee reviewed the quarterly figures for the northern warehouse, noting "
          "that shipments of copper fittings rose while orders for timber fell. ")


def commands(bin_dir: Path, model_dir: str, ports: dict, data: Path,
             adapter: Path | None = None) -> dict[str, list[str]]:
    """The servers to run: rlproxy and mlx_lm.server always, the others where installed and
    no ADAPTER is served (they take none in mlx-lm's layout)."""
    out = {"rlproxy": [sys.executable, "-m", "rlproxy.cli", "serve", "--model", model_dir,
                       "--port", str(ports["rlproxy"]), "--no-train", "--no-judge",
                       "--data-dir", str(data), "--log-level", "WARNING"],
           "mlx_lm": [sys.executable, "-m", "mlx_lm.server", "--model", model_dir,
                      "--port", str(ports["mlx_lm"]), "--log-level", "WARNING"]}
    if adapter is not None:
        out["rlproxy"] += ["--adapter", str(adapter)]
        out["mlx_lm"] += ["--adapter-path", str(adapter)]
        return out
    if (bin_dir / "vllm-mlx").exists():
        out["vllm_mlx"] = [str(bin_dir / "vllm-mlx"), "serve", model_dir, "--port",
                           str(ports["vllm_mlx"]), "--continuous-batching"]
    if (bin_dir / "mlx-openai-server").exists():
        out["mlx_openai"] = [str(bin_dir / "mlx-openai-server"), "launch", "--model-path",
                             model_dir, "--model-type", "lm", "--port", str(ports["mlx_openai"]),
                             "--no-log-file"]  # else it writes logs/app.log in the cwd
    return out


def write_adapter(model: str, path: Path, seed: int = 0) -> Path:
    """rlproxy's fresh adapter for MODEL (its default LoRA layers, rank and scale) with lora_b
    drawn too (a fresh one is zero), written in mlx-lm's layout to PATH."""
    import mlx.core as mx

    from rlproxy.serving.model import load_serving_model, lora_weights, save_adapter
    from rlproxy.settings import ModelSettings

    loaded = load_serving_model(ModelSettings(model=model), lora_seed=seed)
    weights = lora_weights(loaded.model)
    drawn = {k: mx.random.normal(v.shape, key=mx.random.key(seed + i)).astype(v.dtype) * 0.01
             for i, (k, v) in enumerate(sorted(weights.items())) if k.endswith("lora_b")}
    loaded.model.load_weights(list(drawn.items()), strict=False)
    return save_adapter(loaded.model, loaded.lora_config, path)


def prompt_text(tokenizer, tokens: int, opening: str) -> str:
    """OPENING, then filler cut to about TOKENS tokens in all (chat template included)."""
    ids = tokenizer.encode(FILLER * (tokens // 10 + 10))[: max(1, tokens - 40)]
    return f"{opening}\n{tokenizer.decode(ids)}\nSummarise the above in detail."


def stream(url: str, model: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: TTFT, completion tokens, seconds. A connection the
    server resets before answering (mlx_lm.server's listen backlog is 5: 16 clients at once
    can overflow it) is tried again, up to 3 times, from a fresh clock; `retries` counts them."""
    for retries in range(4):
        try:
            return {**_stream_once(url, model, text, max_tokens), "retries": retries}
        except requests.ConnectionError:
            if retries == 3:
                raise
            time.sleep(0.05)


def _stream_once(url: str, model: str, text: str, max_tokens: int) -> dict:
    """(TTFT, completion tokens, seconds, the text)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    tic = time.perf_counter()
    ttft, deltas, usage, content = None, 0, None, []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    deltas += 1
                    content.append(choice["delta"]["content"])
                    if ttft is None:
                        ttft = time.perf_counter() - tic
    return {"ttft_s": ttft, "tokens": usage or deltas, "s": time.perf_counter() - tic,
            "text": "".join(content)}


def round_of(url: str, model: str, texts: list[str], max_tokens: int) -> dict:
    results: list[dict] = [{}] * len(texts)

    def one(i: int) -> None:
        results[i] = stream(url, model, texts[i], max_tokens)
    tic = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    return {"wall_s": wall, "tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_s": statistics.median([r["ttft_s"] for r in results if r["ttft_s"]] or [0.0])
            or None,  # None: no request streamed any content
            "requests": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers-bin", type=Path, default=Path(".peers/bin"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[400, 2000])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", nargs="+", help="run only these servers (rlproxy always)")
    p.add_argument("--same-adapter", action="store_true",
                   help="serve one LoRA adapter on rlproxy and mlx_lm.server (equal work)")
    p.add_argument("--rlproxy-adapter", action="store_true",
                   help="rlproxy serves a trained-like adapter (every lora_b drawn), the peers "
                   "the bare base: what a user with a trained adapter pays")
    p.add_argument("--kinds", nargs="+", default=["unique", "repeated"],
                   choices=["unique", "repeated", "tool", "edit", "summary", "plain"],
                   help="unique/repeated: filler prompts of --prompt-tokens; tool, edit, "
                   "summary: agent outputs that copy from the prompt; plain: prose")
    p.add_argument("--before-too", action="store_true",
                   help="also run rlproxy as it was before speculation and the merged adapter "
                   "(--speculate off --no-merge-lora: rlproxy_before), side by side")
    p.add_argument("--out", type=Path, default=Path("bench/results/vs_peers.json"))
    a = p.parse_args()
    from transformers import AutoTokenizer

    model_dir = resolve_source(a.model, "auto").path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blas = blas_in_use()
    if not blas.startswith("openblas"):
        raise SystemExit(f"OpenBLAS is not loaded ({blas}): install libopenblas0-pthread")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPROXY_")}
    env["LD_PRELOAD"] = blas.split("(", 1)[1].rstrip(")")  # the peers' BLAS: the same library
    a.out.parent.mkdir(parents=True, exist_ok=True)
    ports = {n: free_port() for n in ("rlproxy", "mlx_lm", "vllm_mlx", "mlx_openai",
                                      "rlproxy_before")}
    adapter = (write_adapter(a.model, a.out.parent / "vs_peers_adapter")
               if a.same_adapter or a.rlproxy_adapter else None)
    wanted = commands(a.peers_bin, model_dir, ports, a.out.parent / "vs_peers_data",
                      adapter if a.same_adapter else None)
    if a.rlproxy_adapter:
        wanted["rlproxy"] += ["--adapter", str(adapter)]
    if a.before_too:
        before = list(wanted["rlproxy"])
        before[before.index("--port") + 1] = str(ports["rlproxy_before"])
        before[before.index("--data-dir") + 1] += "_before"
        wanted["rlproxy_before"] = before + ["--speculate", "off", "--no-merge-lora"]
    if a.only:
        wanted = {n: c for n, c in wanted.items() if n.startswith("rlproxy") or n in a.only}
    logs = {n: a.out.parent / f"vs_peers_{n}.log" for n in wanted}
    procs = {n: start(c, env, logs[n]) for n, c in wanted.items()}
    urls = {n: f"http://127.0.0.1:{ports[n]}" for n in procs}
    result = {"model": a.model, "dir": model_dir, "blas": blas, "max_tokens": a.max_tokens,
              "adapter": {"rlproxy": "drawn" if adapter else "fresh (version 0)",
                          "peers": "the same" if a.same_adapter else "none"},
              "servers": {n: " ".join(c) for n, c in wanted.items()},
              "load_before": os.getloadavg()[0], "shapes": []}
    # The name each server is asked for. mlx_lm.server applies --adapter-path only to the model
    # it calls "default_model"; asked for the directory, it serves the bare base.
    names = {n: "default_model" if a.same_adapter and n == "mlx_lm" else model_dir
             for n in procs}
    try:
        for n in procs:
            wait_ready(urls[n], procs[n], logs[n])
            stream(urls[n], names[n], "warm up", 8)  # first-call compilation and allocation
        if a.same_adapter:
            same_greedy_text(urls, names)
        for kind in [k for k in a.kinds if k not in ("unique", "repeated")]:
            for c in a.concurrency:
                shape = {"prompt_tokens": None, "kind": kind, "concurrency": c,
                         "rounds": {n: [] for n in procs}}
                for r in range(a.rounds):
                    texts = [agent_text(kind, f"{r}{i}{uuid.uuid4().hex[:4]}") for i in range(c)]
                    for n in procs:  # the same prompts on each server: their texts compare
                        shape["rounds"][n].append(round_of(urls[n], names[n], texts,
                                                           a.max_tokens))
                summarise(shape)
                result["shapes"].append(shape)
        for tokens in [t for t in a.prompt_tokens if {"unique", "repeated"} & set(a.kinds)]:
            repeated = prompt_text(tokenizer, tokens, "A fixed report.")
            for n in procs:  # the repeated prompt, cached once per server before it counts
                stream(urls[n], names[n], repeated, 4)
            for kind in [k for k in ("unique", "repeated") if k in a.kinds]:
                for c in a.concurrency:
                    shape = {"prompt_tokens": tokens, "kind": kind, "concurrency": c,
                             "rounds": {n: [] for n in procs}}
                    for _ in range(a.rounds):  # alternate: load on the machine hits all alike
                        for n in procs:
                            texts = [repeated if kind == "repeated" else
                                     prompt_text(tokenizer, tokens, f"Report {uuid.uuid4()}.")
                                     for _ in range(c)]
                            shape["rounds"][n].append(round_of(urls[n], names[n], texts,
                                                               a.max_tokens))
                    summarise(shape)
                    result["shapes"].append(shape)
        result["rlproxy_speculation"] = speculation(urls["rlproxy"])
        print("rlproxy speculation:", result["rlproxy_speculation"])
    finally:
        stop_all(procs.values())
    result["load_after"] = os.getloadavg()[0]
    print(f"model dir {model_dir}; BLAS {blas} (peers: LD_PRELOAD); load "
          f"{result['load_before']:.1f} -> {result['load_after']:.1f}")
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


def speculation(url: str) -> dict:
    """rlproxy's speculation counters (/metrics): acceptance rate and tokens per step."""
    text = requests.get(url + "/metrics", timeout=30).text
    c = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
         if line.startswith("rlproxy_spec_")}
    steps, drafted = c.get("rlproxy_spec_steps_total", 0), c.get(
        "rlproxy_spec_drafted_tokens_total", 0)
    return {"steps": steps, "tokens_per_step": c.get("rlproxy_spec_tokens_total", 0) / steps
            if steps else None, "acceptance": c.get("rlproxy_spec_accepted_tokens_total", 0)
            / drafted if drafted else None}


def same_greedy_text(urls: dict, names: dict) -> None:
    """Equal work means the same model: one greedy completion must read the same on each."""
    texts = {}
    for n, url in urls.items():
        body = {"model": names[n], "max_tokens": 24, "temperature": 0.0,
                "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        texts[n] = r.json()["choices"][0]["message"]["content"]
    if len(set(texts.values())) != 1:
        raise SystemExit(f"the servers do not serve the same model: {texts}")
    print(f"same greedy text on {', '.join(texts)}: {texts['rlproxy'][:40]!r}")


def summarise(shape: dict) -> None:
    """Per server: tokens/s (sum over rounds) and median TTFT; ratios against rlproxy; printed."""
    figures = {}
    for n, rounds in shape["rounds"].items():
        tok_s = sum(sum(r["tokens"] for r in x["requests"]) for x in rounds) / sum(
            x["wall_s"] for x in rounds)
        ttfts = [x["ttft_s"] for x in rounds if x["ttft_s"]]
        figures[n] = {"tok_s": tok_s, "ttft_s": statistics.median(ttfts) if ttfts else None,
                      "request_s": statistics.mean(r["s"] for x in rounds for r in x["requests"])}
    mine = figures["rlproxy"]
    for n, f in figures.items():
        f["tok_s_ratio"] = mine["tok_s"] / f["tok_s"] if f["tok_s"] else None
        f["ttft_ratio"] = mine["ttft_s"] / f["ttft_s"] if f["ttft_s"] and mine["ttft_s"] else None
        f["request_s_ratio"] = mine["request_s"] / f["request_s"]
    shape["figures"] = figures
    # greedy everywhere: the same prompt must give the same text on each server
    texts = {n: [r["text"] for x in rounds for r in x["requests"]]
             for n, rounds in shape["rounds"].items()}
    shape["same_text"] = {n: sum(a == b for a, b in zip(t, texts["rlproxy"])) / len(t)
                          for n, t in texts.items() if n != "rlproxy"}
    size = f"{shape['prompt_tokens']:5d} tok" if shape["prompt_tokens"] else "agent    "
    head = f"{size} {shape['kind']:8s} x{shape['concurrency']:<3d}"
    def ms(x):
        return f"{x * 1000:6.0f} ms" if x else "  none"

    def ratio(x):
        return f"{x:.2f}x" if x else "-"
    parts = [f"rlproxy {mine['tok_s']:6.1f} tok/s ttft {ms(mine['ttft_s'])} "
             f"request {mine['request_s']:5.2f} s"]
    for n, f in figures.items():
        if n != "rlproxy":
            parts.append(f"{n} {f['tok_s']:6.1f} tok/s ({f['tok_s_ratio']:.2f}x) ttft "
                         f"{ms(f['ttft_s'])} ({ratio(f['ttft_ratio'])}) request "
                         f"{f['request_s']:5.2f} s ({f['request_s_ratio']:.2f}x) same text "
                         f"{shape['same_text'][n]:.0%}")
    print(head + " | " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
