"""Judge and teacher backends: where votes, hints and teacher log-probs come from.

Two backends with the same two async methods, `complete(messages, temperature, max_tokens,
seed) -> str` and `teacher_logprobs(prompt_ids, completion_ids) -> list[float]`:
- LocalJudge: a second, adapter-free copy of the base model in its own thread (so judging can
  never change the serving adapter). While live requests are decoding it pauses between tokens
  (`judge_yield_ms`), so it cannot starve them.
- RemoteJudge: any OpenAI-compatible URL for votes and hints; for teacher log-probs it needs a
  server that returns prompt log-probs for token-id prompts (vLLM's /v1/completions with
  `prompt_logprobs`), serving a model with the serving model's tokenizer.
Transport failures are retried with exponential backoff; what is still failing after the retries
raises JudgeUnavailable, which the scorer treats as an outage (the turn waits, nothing is lost).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

import aiohttp

from rlproxy.scoring.rewards import settle

log = logging.getLogger("rlproxy.judges")
PREFILL_STEP = 2048  # teacher positions per forward pass (the engine's default prefill step)


class JudgeUnavailable(Exception):
    """The judge could not be reached (after retries): try the turn again later."""


class LocalJudge:
    def __init__(self, model, tokenizer, busy: Callable[[], bool] = lambda: False,
                 yield_ms: float = 20.0):
        self.model, self.tokenizer = model, tokenizer
        self.busy, self.yield_s = busy, yield_ms / 1000
        self._tasks: queue.Queue = queue.Queue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rlproxy-judge", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True  # queued work is dropped: its turns are rescored after a restart
        self._tasks.put(None)
        self._thread.join(timeout=30)

    async def _call(self, fn, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._tasks.put((fn, args, loop, future))
        return await future

    def _run(self) -> None:
        from rlproxy.serving.mlx_threads import mlx_thread

        with mlx_thread():
            while (task := self._tasks.get()) is not None:
                fn, args, loop, future = task
                if self._closing:
                    continue
                try:
                    result, error = fn(*args), None
                except Exception as e:  # delivered to the awaiting coroutine
                    result, error = None, e
                try:
                    loop.call_soon_threadsafe(settle, future, result, error)
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass

    async def complete(self, messages, temperature: float, max_tokens: int, seed: int) -> str:
        return await self._call(self._generate, messages, temperature, max_tokens, seed)

    async def teacher_logprobs(self, prompt_ids: list[int], completion_ids: list[int]):
        return await self._call(self._logprobs, prompt_ids, completion_ids)

    def _generate(self, messages, temperature, max_tokens, seed) -> str:
        from mlx_lm.generate import generate_step

        from rlproxy.serving.sampler import make_sampler

        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        import mlx.core as mx

        ids = []
        for token, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_tokens,
                                      sampler=make_sampler(temperature, 1.0, seed)):
            token = int(token)
            if token in self.tokenizer.eos_token_ids:
                break
            ids.append(token)
            self._yield(0.0)
        return self.tokenizer.decode(ids)

    def _logprobs(self, prompt_ids, completion_ids) -> list[float]:
        """log p(completion | prompt) per token, at temperature 1 (the quantity the engine
        records), PREFILL_STEP positions at a time: a long prompt never materialises logits for
        every position."""
        from rlproxy.serving.logprobs import sequence_logprobs

        ids = list(prompt_ids) + list(completion_ids)
        return sequence_logprobs(self.model, ids, start=len(prompt_ids), step=PREFILL_STEP,
                                 between=self._yield).tolist()

    def _yield(self, _spent: float) -> None:
        if self.busy() and self.yield_s:
            time.sleep(self.yield_s)  # live traffic first


class RemoteJudge:
    def __init__(self, url: str, model: str, api_key: str | None, timeout_s: float,
                 retries: int, teacher_url: str | None = None):
        self.url, self.teacher_url = url.rstrip("/") if url else None, teacher_url
        self.model, self.retries = model, retries
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, url: str, body: dict) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        delay, last = 0.5, None
        for attempt in range(self.retries + 1):
            try:
                async with self._session.post(url, json=body) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        last = f"HTTP {resp.status}"
                    elif resp.status >= 400:
                        raise JudgeUnavailable(f"{url} answered HTTP {resp.status}: "
                                               f"{(await resp.text())[:200]}")
                    else:
                        return await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise JudgeUnavailable(f"{url}: {last} (after {self.retries + 1} attempts)")

    async def complete(self, messages, temperature: float, max_tokens: int, seed: int) -> str:
        data = await self._post(f"{self.url}/chat/completions", {
            "model": self.model, "messages": messages, "temperature": temperature,
            "max_tokens": max_tokens, "seed": seed})
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return ""  # a malformed answer is an invalid vote, not an outage

    async def teacher_logprobs(self, prompt_ids: list[int], completion_ids: list[int]):
        url = (self.teacher_url or self.url).rstrip("/")
        data = await self._post(f"{url}/completions", {
            "model": self.model, "prompt": prompt_ids + completion_ids, "max_tokens": 1,
            "prompt_logprobs": 0, "temperature": 0})
        # vLLM: choices[0].prompt_logprobs[i] = {str(token_id): {"logprob": ...}} (None at 0)
        rows = data["choices"][0]["prompt_logprobs"][len(prompt_ids):]
        return [row[str(tid)]["logprob"] for row, tid in zip(rows, completion_ids)]
