"""Tinker sampling sessions: which weights a sampler samples from, and `asample` itself.

All sampling goes through the proxy's one engine. A session made on the base model samples with
the live adapter (the default). A session made from saved sampler weights names an adapter the
engine serves beside the live one (serving/saved.py: a model object that shares the serving
model's frozen base arrays and carries the saved LoRA weights; at most MAX_ADAPTERS loaded, the
least recently used dropped first; weights that many samples ask for at the same moment, as a
recipe's rollouts right after save_weights_and_get_sampling_client, are loaded once). Each job
carries the model object it was admitted with, so a sampler dropped or replaced meanwhile never
fails a sample under way.
Prompt log-probs (compute_logprobs) are computed on the Tinker worker thread from the same model
object the session samples with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlproxy.mlx_threads import Worker
from rlproxy.serving.engine import Engine, Job, SamplingParams, asyncio_delivery
from rlproxy.serving.saved import SavedAdapters
from rlproxy.tinker import models
from rlproxy.tinker.wire import UserError


class Samplers:
    """Sampling sessions -> the weights each samples with: the live adapter, or saved sampler
    weights served by name (serving/saved.py, the path `MODEL@STEP` requests take too)."""

    def __init__(self, loaded, engine: Engine, worker: Worker, saved: SavedAdapters):
        self.loaded, self.engine, self.worker, self.saved = loaded, engine, worker, saved
        self.sessions: dict[str, dict] = {}  # id -> {"path": Path | None, "model_path": str}

    def open(self, session_id: str, path: Path | None, model_path: str | None) -> None:
        self.sessions[session_id] = {"path": path, "model_path": model_path}

    async def adapter_for(self, session_id: str) -> tuple[str | None, object]:
        """(the engine's adapter name, None for the live one; the model it samples with)."""
        if session_id not in self.sessions:
            raise UserError(f"unknown sampling session {session_id!r}")
        path = self.sessions[session_id]["path"]
        if path is None:
            return None, self.loaded.model
        where = self.sessions[session_id]["model_path"]
        try:  # a save under the same name replaces the weights: a new name for the engine
            return await self.saved.model_for(path)
        except FileNotFoundError:
            raise UserError(f"no sampler weights at {where}") from None
        except ValueError as e:  # serving/model.py's check: they do not fit this model
            raise UserError(f"the sampler weights at {where} do not fit this model: {e}") \
                from None


def check_prompt(ids: list[int], max_tokens: int, vocab: int, context: int) -> None:
    if not ids:
        raise UserError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise UserError(f"prompt token id {bad[0]} is outside the vocabulary of {vocab}")
    if len(ids) + max_tokens > context:
        raise UserError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the "
                        f"model's context of {context}")


def stops_of(stop) -> tuple[set[int], list[str]]:
    """Tinker's `stop`: a string, a list of strings, or a list of token ids."""
    if stop is None:
        return set(), []
    if isinstance(stop, str):
        return set(), [stop]
    if all(isinstance(s, int) for s in stop):
        return set(stop), []
    if all(isinstance(s, str) for s in stop):
        return set(), list(stop)
    raise UserError("stop must be a string, a list of strings or a list of token ids")


async def sample_one(engine: Engine, adapter: str | None, model, ids: list[int],
                     params: SamplingParams, stop_ids: set[int], stop_strs: list[str],
                     tokenizer) -> dict:
    """One sequence from ADAPTER (None: the live one), whose model object is MODEL."""
    loop, q = asyncio.get_running_loop(), asyncio.Queue()
    job = engine.submit(Job(list(ids), params, asyncio_delivery(loop, q), adapter=adapter,
                            adapter_model=model if adapter is not None else None))
    tokens, logprobs, reason = [], [], "length"
    try:
        while True:
            step = await q.get()
            if step.error:
                raise RuntimeError(f"sampling failed: {step.error}")
            tokens.append(step.token.id)
            logprobs.append(step.token.logprob)
            if step.finish_reason is not None:
                reason = "stop" if step.finish_reason == "stop" else "length"
                break
            if step.token.id in stop_ids or (stop_strs and any(
                    s in tokenizer.decode(tokens) for s in stop_strs)):
                reason = "stop"
                break
    finally:
        if not job.done:
            engine.cancel(job)
    return {"tokens": tokens, "logprobs": logprobs, "stop_reason": reason}


async def asample(samplers: Samplers, body: dict) -> tuple[list[dict], list | None]:
    """(sequences, prompt log-probs or None) for one `asample` body."""
    loaded = samplers.loaded
    ids = [t for c in body.get("prompt", {}).get("chunks", []) for t in c.get("tokens", [])]
    sp = body.get("sampling_params") or {}
    max_tokens = int(sp.get("max_tokens") or 16)
    n = int(body.get("num_samples") or 1)
    if not 1 <= n <= 64:
        raise UserError(f"num_samples must be between 1 and 64, got {n}")
    check_prompt(ids, max_tokens, loaded.vocab_size, loaded.context_length)
    stop_ids, stop_strs = stops_of(sp.get("stop"))
    if not samplers.engine.alive or samplers.engine.error:
        raise RuntimeError(f"the engine is not running: {samplers.engine.error}")
    adapter, model = await samplers.adapter_for(body.get("sampling_session_id") or "")
    seed = sp.get("seed")
    params = [SamplingParams(max_tokens=max_tokens, temperature=float(sp.get("temperature", 1.0)),
                             top_p=float(sp.get("top_p", 1.0)), top_k=max(0, int(sp.get("top_k")
                                                                               or 0)),
                             seed=None if seed is None else int(seed) + i) for i in range(n)]
    sequences = await asyncio.gather(*[sample_one(samplers.engine, adapter, model, ids, p,
                                                  stop_ids, stop_strs, loaded.tokenizer)
                                       for p in params])
    prompt_lps = None
    if body.get("prompt_logprobs"):
        prompt_lps = await asyncio.wrap_future(
            samplers.worker.run(models.prompt_logprobs, model, ids))
    return list(sequences), prompt_lps
