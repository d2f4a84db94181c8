"""Judge and teacher backends: where votes, hints and teacher log-probs come from.

Two backends with the same three async methods, `complete(messages, temperature, max_tokens,
seed) -> str`, `verdict(prompt, words) -> {token: log-prob} | None` (the log-probs at the label
position of a raw-text prompt that ends where the label goes: one forward pass, no sampling;
None: the backend gives no log-probs, and the scorer falls back to votes) and
`teacher_logprobs(prompt_ids, completion_ids) -> list[float]`:
- LocalJudge: a second, adapter-free copy of the base model in its own thread (so judging can
  never change the serving adapter). While live requests are decoding it pauses between tokens
  (`judge_yield_ms`), so it cannot starve them.
  Its verdicts reuse the KV of the prompt's constant head (the few-shot examples, before the
  filled prompt's last blank line), so each verdict prefills only this turn's part.
- RemoteJudge: any OpenAI-compatible URL for votes and hints; verdicts through its
  `/completions` with `logprobs` (OpenAI's legacy shape, as vLLM answers it, or the
  `logprobs: true, top_logprobs` shape of mlx-lm's server); for teacher log-probs it needs a
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

from rlproxy.scoring.judging import label_variants, split_head
from rlproxy.scoring.rewards import settle

log = logging.getLogger("rlproxy.judges")
PREFILL_STEP = 2048  # teacher positions per forward pass (the engine's default prefill step)


class JudgeUnavailable(Exception):
    """The judge could not be reached (after retries): try the turn again later."""


class JudgeRefused(JudgeUnavailable):
    """The judge answered the request with a 4xx (`status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class LocalJudge:
    def __init__(self, model, tokenizer, busy: Callable[[], bool] = lambda: False,
                 yield_ms: float = 20.0):
        self.model, self.tokenizer = model, tokenizer
        self.busy, self.yield_s = busy, yield_ms / 1000
        self._tasks: queue.Queue = queue.Queue()
        self._closing = False
        self._head = None  # (head text, its prefilled KV cache): verdicts only, judge thread
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
        from rlproxy.mlx_threads import mlx_thread

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

    async def verdict(self, prompt: str, words: list[str]) -> dict[str, float]:
        return await self._call(self._verdict, prompt, words)

    def _verdict(self, prompt: str, words: list[str]) -> dict[str, float]:
        """log p(next token) for each label spelling of WORDS after PROMPT (exact: the full
        distribution, not a top-k). The head of PROMPT (before its last blank line: the few-shot
        examples) is prefilled once and its KV kept, when the head and the tail tokenize as the
        whole prompt does and the cache can be trimmed; each verdict then prefills the tail and
        trims the cache back to the head. Otherwise the whole prompt is prefilled each time."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, \
            trim_prompt_cache

        from rlproxy.serving.logprobs import prefill, spans

        head, tail = split_head(prompt)
        if self._head is None or self._head[0] != head:
            head_ids = self.tokenizer.encode(head)
            tail_ids = self.tokenizer.encode(tail, add_special_tokens=False)
            self._head = None
            if head_ids + tail_ids == self.tokenizer.encode(prompt):
                cache = prefill(self.model, head_ids, spans(len(head_ids), PREFILL_STEP),
                                self._yield)
                if can_trim_prompt_cache(cache):
                    self._head = (head, cache, len(head_ids))
        if self._head is None:  # no head to reuse: the whole prompt
            lp = self._next_logprobs(make_prompt_cache(self.model),
                                     self.tokenizer.encode(prompt))
        else:
            _, cache, head_len = self._head
            try:
                lp = self._next_logprobs(cache,
                                         self.tokenizer.encode(tail, add_special_tokens=False))
            finally:  # back to the head alone, whatever was prefilled
                trim_prompt_cache(cache, cache[0].offset - head_len)
        return {spelling: lp[token].item() for spelling, token in self._label_tokens(words)}

    def _next_logprobs(self, cache: list, ids: list[int]):
        """log p(the token after IDS), IDS prefilled into CACHE in PREFILL_STEP chunks (KV
        only), each followed by a pause while live requests decode."""
        import mlx.core as mx

        from rlproxy.serving.logprobs import log_softmax, spans

        for a, b in spans(len(ids) - 1, PREFILL_STEP):
            self.model(mx.array(ids[a:b])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self._yield(0.0)
        lp = log_softmax(self.model(mx.array(ids[-1:])[None], cache=cache)[0, -1])
        mx.eval(lp)
        return lp

    def _label_tokens(self, words: list[str]) -> list[tuple[str, int]]:
        """(spelling, token id) of each label's spellings: the spelling's first token (a word
        that is not one token is read by its first), each token once, and none that two
        labels share (it cannot tell them apart)."""
        firsts: dict[int, set[str]] = {}
        spelled: dict[int, str] = {}
        for word in words:
            for spelling in label_variants(word):
                ids = self.tokenizer.encode(spelling, add_special_tokens=False)
                if ids:
                    firsts.setdefault(ids[0], set()).add(word)
                    spelled.setdefault(ids[0], spelling)
        return [(spelled[t], t) for t, owners in firsts.items() if len(owners) == 1]

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
        self._shape: dict | None = None  # the log-prob request shape the server took

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
                        raise JudgeRefused(f"{url} answered HTTP {resp.status}: "
                                           f"{(await resp.text())[:200]}", resp.status)
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

    async def verdict(self, prompt: str, words: list[str]) -> dict[str, float] | None:
        """The top log-probs of the one token after PROMPT, from `/completions`. The first
        call finds the shape the server takes: OpenAI's legacy `logprobs: 20` (vLLM), else, if
        that is refused with 400/404/405/422, `logprobs: true, top_logprobs` (mlx-lm's
        server). None when the server answers without log-probs or refuses both shapes (no
        `/completions`): the scorer then falls back to votes. Once a shape has worked, a
        failure is what it is: an outage (the turn waits) or, for an answer without log-probs,
        no verdict for this turn ({})."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        url = f"{self.url}/completions"
        if self._shape is not None:
            return top_logprobs(await self._post(url, {**body, **self._shape})) or {}
        for shape in LOGPROB_SHAPES:
            try:
                data = await self._post(url, {**body, **shape})
            except JudgeRefused as e:
                if e.status not in (400, 404, 405, 422):
                    raise
                log.info("judge %s refused log-probs asked as %s: %s", self.url, shape, e)
                continue
            top = top_logprobs(data)
            if top is not None:
                self._shape = shape
            return top
        return None

    async def teacher_logprobs(self, prompt_ids: list[int], completion_ids: list[int]):
        url = (self.teacher_url or self.url).rstrip("/")
        data = await self._post(f"{url}/completions", {
            "model": self.model, "prompt": prompt_ids + completion_ids, "max_tokens": 1,
            "prompt_logprobs": 0, "temperature": 0})
        # vLLM: choices[0].prompt_logprobs[i] = {str(token_id): {"logprob": ...}} (None at 0)
        rows = data["choices"][0]["prompt_logprobs"][len(prompt_ids):]
        return [row[str(tid)]["logprob"] for row, tid in zip(rows, completion_ids)]


# the two ways OpenAI-compatible servers are asked for the top log-probs of a completion token
LOGPROB_SHAPES = ({"logprobs": 20}, {"logprobs": True, "top_logprobs": 10})


def top_logprobs(data: dict) -> dict[str, float] | None:
    """{token: log-prob} of the first completion token of a `/completions` answer, in either
    shape servers use: OpenAI's legacy `logprobs.top_logprobs[0]` ({token: lp}, as vLLM) or
    `logprobs.content[0].top_logprobs` ([{token, logprob}], as mlx-lm's server). None when the
    answer carries no log-probs."""
    try:
        logprobs = data["choices"][0].get("logprobs") or {}
        if logprobs.get("top_logprobs"):
            first = logprobs["top_logprobs"][0]
            return {str(t): float(lp) for t, lp in first.items()} or None
        if logprobs.get("content"):
            first = logprobs["content"][0].get("top_logprobs") or []
            return {str(e["token"]): float(e["logprob"]) for e in first} or None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        pass
    return None
