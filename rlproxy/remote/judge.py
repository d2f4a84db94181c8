"""`--judge-url tinker` / `--teacher-url tinker`: the judge and the OPD teacher are the Tinker
service's base-model sampling client, as OpenClaw-Tinker has them.

`TinkerJudge` has scoring/judges.py's two calls: `complete` samples the judge's chat prompt
(templated here, with the served model's tokenizer) and `teacher_logprobs` asks the service for
the prompt log-probs of prompt + completion (`sample` with `prompt_logprobs`, max_tokens 1, as
the SDK's `compute_logprobs` does) and keeps the completion's. What the service cannot do now
raises JudgeUnavailable, which the scorer treats as an outage: the turn waits, nothing is lost.

Not here: the clients themselves (remote/sampler.py's SamplingClients), the scorer.
"""

from __future__ import annotations

import asyncio

from rlproxy.remote.sampler import SamplingClients
from rlproxy.remote.service import LearnerRefused, LearnerUnavailable
from rlproxy.scoring.judges import JudgeUnavailable
from rlproxy.settings import RemoteSettings

TINKER = "tinker"  # the --judge-url / --teacher-url value that means the service's base model


class TinkerJudge:
    def __init__(self, r: RemoteSettings, base_model: str, tokenizer):
        self.tokenizer = tokenizer
        self.clients = SamplingClients(r, base_model)

    def close(self) -> None:
        self.clients.drop("success")

    async def _sample(self, ids: list[int], params, prompt_logprobs: bool = False):
        try:
            return await self.clients.sample(None, ids, params, prompt_logprobs=prompt_logprobs)
        except (LearnerRefused, LearnerUnavailable) as e:
            raise JudgeUnavailable(str(e)) from None

    async def complete(self, messages, temperature: float, max_tokens: int, seed: int) -> str:
        from tinker import types

        ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages,
                                      add_generation_prompt=True)
        eos = sorted(self.tokenizer.eos_token_ids)
        reply = await self._sample(list(ids), types.SamplingParams(
            max_tokens=max_tokens, seed=seed, temperature=temperature, stop=eos))
        tokens = [t for t in reply.sequences[0].tokens if t not in eos]
        return self.tokenizer.decode(tokens)

    async def verdict(self, prompt: str, words: list[str]) -> None:
        """No top log-probs from a Tinker sampler here: the scorer falls back to votes."""
        return None

    async def teacher_logprobs(self, prompt_ids: list[int], completion_ids: list[int]):
        """log p(completion | prompt) per token under the service's base model, at
        temperature 1 (what the engine records)."""
        from tinker import types

        reply = await self._sample(list(prompt_ids) + list(completion_ids),
                                   types.SamplingParams(max_tokens=1), prompt_logprobs=True)
        lps = list(reply.prompt_logprobs or [])[len(prompt_ids):]
        if len(lps) != len(completion_ids) or any(lp is None for lp in lps):
            raise JudgeUnavailable(f"the Tinker service gave {len(lps)} prompt log-probs for "
                                   f"{len(completion_ids)} completion tokens")
        return [float(lp) for lp in lps]
