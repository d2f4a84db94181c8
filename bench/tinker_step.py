"""One Tinker training step through the SDK vs the same step called directly.

    python bench/tinker_step.py [--size tiny|small] [--batch 8] [--tokens 128] [--reps 20]
                                [--out bench/results/tinker_step.json]

Through the SDK: `forward_backward(data, "cross_entropy")` + `optim_step(AdamParams)` with the
real `tinker` client against the real server on a free port (protobuf body, request ids,
seq_id ordering, long-polled futures, the worker thread). Directly: the very functions that
worker runs (`rlproxy.tinker.models.forward_backward` + `optim_step`) on a model of the same
rank, on this thread, with no HTTP. The two alternate, step by step, so machine load hits both
alike. Reported: median and p90 seconds per step of each, and the ratio of the medians
(goal <= 1.15).
"""

import rlproxy  # noqa: I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import environment, percentile, report, start_server
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings, load_settings
from rlproxy.tinker import models


def serve_in_background(settings, loaded):
    """The real app on its own event loop thread: (base url, stop function)."""
    loop = asyncio.new_event_loop()
    box, ready = {}, threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(start_server(settings, loaded))
        ready.set()
        loop.run_forever()
        loop.run_until_complete(box["runner"].cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(120)

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
    return box["url"], stop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="bench/results/tinker_step.json")
    a = p.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    load_before = os.getloadavg()[0]
    loaded = load_serving_model(ModelSettings(model=a.size))
    rng = np.random.default_rng(0)
    seqs = rng.integers(3, loaded.vocab_size, size=(a.batch, a.tokens + 1))
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": s[1:].astype(np.int64),
                                        "weights": np.ones(a.tokens, dtype=np.float32)})
            for s in seqs]
    direct_req = {"loss_fn": "cross_entropy", "loss_fn_config": {}, "forward_only": False,
                  "data": [{"tokens": s[:-1].tolist(),
                            "inputs": {"target_tokens": s[1:].astype(np.int64),
                                       "weights": np.ones(a.tokens, dtype=np.float32)}}
                           for s in seqs]}
    adam = {"learning_rate": 1e-4}
    settings = load_settings({"data_dir": tempfile.mkdtemp(), "train": False,
                              "model": a.size}, environ={})
    url, stop = serve_in_background(settings, loaded)
    try:
        tc = tinker.ServiceClient(base_url=url, api_key="tml-local").create_lora_training_client(
            base_model=loaded.model_id, rank=a.rank).result()
        direct = models.new_model(loaded, "bench", "bench", a.rank, 0)

        def sdk_step():
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            fb.result()

        def direct_step():
            models.forward_backward(direct, direct_req, loaded.vocab_size, loaded.context_length)
            models.optim_step(direct, adam)

        for f in (sdk_step, direct_step):  # warm-up: compile, first allocations
            f()
        times = {"sdk": [], "direct": []}
        for _ in range(a.reps):
            for name, f in (("sdk", sdk_step), ("direct", direct_step)):
                tic = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - tic)
    finally:
        stop()
    med = {k: percentile(v, 50) for k, v in times.items()}
    result = environment(a.size, load_before, loaded.model_id,
                         {"batch": a.batch, "tokens": a.tokens, "rank": a.rank, "reps": a.reps})
    result |= {"median_s": med, "p90_s": {k: percentile(v, 90) for k, v in times.items()},
               "ratio_sdk_over_direct": med["sdk"] / med["direct"], "goal_ratio": 1.15,
               "times_s": times}
    report([f"one forward_backward + optim_step, {a.batch} x {a.tokens} tokens, rank {a.rank}, "
            f"{a.size} model, median of {a.reps}:",
            f"  through the tinker SDK: {med['sdk'] * 1000:.1f} ms",
            f"  direct (same functions, no HTTP): {med['direct'] * 1000:.1f} ms",
            f"  ratio {med['sdk'] / med['direct']:.3f} (goal <= 1.15)"], result, Path(a.out))


if __name__ == "__main__":
    main()
