"""`MODEL@STEP`: a kept checkpoint served read-only by name beside the live adapter (for A/B
comparisons and rollbacks by name), through the same path as the Tinker API's sampler weights
(serving/saved.py). The real app on a real port, the openai and anthropic SDKs, and a second,
independent reading of the checkpoint: mlx-lm's own loader with its `adapter_path`."""

from __future__ import annotations

import shutil

import anthropic
import mlx.core as mx
import mlx_lm
import openai
import pytest
import requests

from rlproxy import paths
from conftest import ServerThread
from demo_agent import run_sessions, training_settings, wait_for_steps

QUESTION = [{"role": "user", "content": "Name three colours of the sea at dusk."}]


def greedy(client, model: str):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                       temperature=0, logprobs=True)
    return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]


@pytest.mark.slow
def test_a_checkpoint_is_served_by_name_read_only_beside_the_live_adapter(own, tmp_path):
    with ServerThread(training_settings(tmp_path), own) as s:
        c = s.client()
        with pytest.raises(openai.NotFoundError) as missing:
            greedy(c, "m@1")
        assert "no complete checkpoint of step 1 is kept (kept: none)" in str(missing.value)
        assert missing.value.body["param"] == "model"
        served = c.models.list().data[0].id  # GET /v1/models/{id} knows served names only
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve(f"{served}@1")
        run_sessions(s.url, 0, 1)
        wait_for_steps(s.url, 1)
        run_sessions(s.url, 1, 1)
        wait_for_steps(s.url, 2)
        sessions = lambda: len(requests.get(s.url + "/v1/sessions").json()["data"])  # noqa: E731
        before = sessions()
        text1, lps1 = greedy(c, "m@1")
        again = greedy(c, "m@1")  # loaded once, served from memory: the same answer
        text2, lps2 = greedy(c, "m@2")
        messages = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0).messages
        claude = messages.create(model="m@1", max_tokens=8, messages=QUESTION,
                                 extra_body={"temperature": 0})  # this SDK: no argument
        with pytest.raises(openai.NotFoundError):
            greedy(c, "m@7")
        # a checkpoint whose adapter misfits the model: refused at its load, nothing else hurt
        misfit = tmp_path / paths.CHECKPOINTS / "step_000009"
        shutil.copytree(paths.kept_checkpoint(tmp_path / paths.CHECKPOINTS, 2), misfit)
        arrays = mx.load(str(misfit / "adapters.safetensors"))
        first = sorted(arrays)[0]
        arrays[first] = arrays[first].T
        mx.save_safetensors(str(misfit / "adapters.safetensors"), arrays)
        with pytest.raises(openai.ConflictError) as refused:
            greedy(c, "m@9")
        assert "checkpoint step_000009 cannot be served by this model" in str(refused.value)
        assert f"{first}: " in str(refused.value)
        assert greedy(c, "m@1") == (text1, lps1)  # the batch and the loaded adapters go on
        assert c.models.retrieve(f"{served}@1").id == f"{served}@1"  # a kept checkpoint
        for unknown in (f"{served}@7", "m@1"):  # no such step; no such name
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve(unknown)
        # read-only: none of these was filed into a session; the live adapter's request is
        at_steps = sessions()
        live = greedy(c, "m")
        assert (at_steps, sessions()) == (before, before + 1)
    assert again == (text1, lps1)
    assert claude.content[0].text == text1  # another dialect, the same adapter
    # step 2's checkpoint holds what the live adapter serves; step 1's is another adapter
    assert live[0] == text2 and live[1] == pytest.approx(lps2, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(lps1, lps2)) > 1e-5
    # mlx-lm's own loader reads checkpoint 1 to the same greedy tokens and log-probs
    step_1 = paths.kept_checkpoint(tmp_path / paths.CHECKPOINTS, 1)
    model, tokenizer = mlx_lm.load(str(own.source), adapter_path=str(step_1))
    model.apply(lambda x: x.astype(mx.float32) if x.dtype != mx.float32 else x)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    want = []
    for _ in range(len(lps1)):
        logits = model(mx.array(ids)[None])[0, -1]
        logp = logits - mx.logsumexp(logits)
        token = int(mx.argmax(logp).item())
        want.append(logp[token].item())
        ids.append(token)
    assert want == pytest.approx(lps1, abs=1e-4)
