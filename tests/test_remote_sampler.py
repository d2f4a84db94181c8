"""--sampler tinker end to end: a replica with no local weights samples on a learner (a real
`rlproxy serve --model tiny --no-train` subprocess answering the Tinker API), driven by the real
`openai` and `anthropic` SDKs. What it serves and records are exactly the learner's own tokens
and log-probs (checked against a tinker SamplingClient on the learner with the same prompt ids
and seed); the judge and teacher on the service (`--judge-url tinker`) agree with it; a wrong
key or base model is a start-up error; a learner that goes away fails requests clearly, shows on
/healthz, and serving recovers when it is back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import anthropic
import openai
import pytest
import requests

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import ServerThread, make_settings  # noqa: E402

from rlproxy.appkeys import ENGINE, MODEL  # noqa: E402
from rlproxy.ops.served import Served, free_port, serve_command, server_env  # noqa: E402
from rlproxy.remote.judge import TinkerJudge  # noqa: E402
from rlproxy.settings import RemoteSettings  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
KEY = "tml-test"
BASE = "rlproxy-embedded-tiny"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
GREEDY = {"temperature": 0.0}  # this anthropic SDK no longer takes temperature as an argument


class Learner:
    """`rlproxy serve --model tiny --no-train --api-key tml-test` on a fixed port, restartable."""

    def __init__(self, data: Path):
        self.data, self.port = data, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served: Served | None = None

    def start(self) -> None:
        self.served = Served(self.data / "d", "--no-train", "--no-judge", "--api-key", KEY,
                             port=self.port, log=self.data / "learner.log")

    def stop(self) -> None:  # SIGKILL: gone at once, as in a crash
        self.served.proc.kill()
        self.served.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    lr = Learner(tmp_path_factory.mktemp("learner"))
    lr.start()
    yield lr
    lr.stop()


@pytest.fixture(scope="module")
def replica(learner, tmp_path_factory):
    data = tmp_path_factory.mktemp("replica")
    settings = make_settings(data, sampler="tinker", tinker_url=learner.url,
                             tinker_api_key=KEY, tinker_timeout_s=3, method="combine")
    with ServerThread(settings) as s:  # no loaded model: the tokenizer alone is loaded
        yield s


def learner_sample(url: str, ids: list[int], max_tokens: int, temperature: float,
                   seed: int | None, eos: list[int]):
    """What the learner itself samples for these prompt ids: (tokens, log-probs)."""
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    client = sc.create_sampling_client(base_model=BASE).result()
    seq = client.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, stop=eos)).result(
        ).sequences[0]
    return list(seq.tokens), [float(x) for x in seq.logprobs]


def recorded_turns(data: Path) -> list[dict]:
    path = data / "pending_turns.jsonl"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            turns = [x for x in lines if x.get("kind") == "turn"]
            if turns:
                return turns
        time.sleep(0.05)
    raise AssertionError("no turn recorded")


def turn_of(data: Path, session: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [t for t in recorded_turns(data) if t["session_id"] == session]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no turn of session {session}")


def test_openai_chat_is_the_learners_own_sampling(learner, replica):
    c = replica.client()
    health = requests.get(replica.url + "/healthz").json()
    assert health["engine"]["backend"] == "tinker" and health["prefix_cache"]["enabled"] is False
    eos = sorted(replica.app[MODEL].tokenizer.eos_token_ids)

    r = c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=12, seed=7,
                                  temperature=1.0, logprobs=True,
                                  extra_headers={"X-Session-Id": "sess-chat"})
    turn = turn_of(replica.data_dir, "sess-chat")
    choice = turn["choices"][0]
    tokens, lps = learner_sample(learner.url, turn["prompt_ids"], 12, 1.0, 7, eos)
    assert choice["completion_ids"] == tokens  # exactly the service's tokens ...
    assert choice["logprobs"] == lps  # ... and log-probs, bit for bit
    assert choice["adapter_versions"] == [0] * len(tokens) and choice["seed"] == 7
    served = [x.logprob for x in r.choices[0].logprobs.content]
    assert served == [lp for t, lp in zip(tokens, lps) if t not in eos]
    sessions = c.get("/sessions", cast_to=object)
    assert any(s["id"] == "sess-chat" for s in sessions["data"])

    # streamed: the same seed gives the same text, in deltas
    stream = c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=12, seed=7,
                                       temperature=1.0, stream=True)
    deltas = [ch.choices[0].delta.content for ch in stream if ch.choices]
    assert "".join(d for d in deltas if d) == r.choices[0].message.content
    assert len([d for d in deltas if d]) > 1
    engine = requests.get(replica.url + "/healthz").json()["engine"]
    assert engine["steps"] >= 2 and engine["service_error"] is None
    assert requests.get(replica.url + "/metrics").status_code == 200
    assert requests.get(replica.url + "/ui/api/overview").status_code == 200  # the dashboard


def test_anthropic_messages_greedy(learner, replica):
    eos = sorted(replica.app[MODEL].tokenizer.eos_token_ids)
    a = anthropic.Anthropic(base_url=replica.url, api_key="unused", max_retries=0)
    m = a.messages.create(model=BASE, max_tokens=10, messages=MESSAGES, extra_body=GREEDY,
                          extra_headers={"X-Session-Id": "sess-msg"})
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens")
    turn = turn_of(replica.data_dir, "sess-msg")
    tokens, lps = learner_sample(learner.url, turn["prompt_ids"], 10, 0.0, None, eos)
    assert turn["choices"][0]["completion_ids"] == tokens
    assert turn["choices"][0]["logprobs"] == lps
    with a.messages.stream(model=BASE, max_tokens=10, extra_body=GREEDY,
                           messages=MESSAGES) as s:
        text = "".join(s.text_stream)
    assert text == "".join(b.text for b in m.content if b.type == "text")


def test_judge_and_teacher_on_the_service(learner, replica):
    """--judge-url tinker / --teacher-url tinker: the service's base model answers the judge
    prompt as the replica's own greedy reply does, and its teacher log-probs of a sampled
    completion are that sample's own log-probs (the learner serves the base model)."""
    r = replica.client().chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=8, temperature=0.0,
        extra_headers={"X-Session-Id": "sess-judge"})
    turn = turn_of(replica.data_dir, "sess-judge")
    choice = turn["choices"][0]
    judge = TinkerJudge(RemoteSettings(tinker_url=learner.url, tinker_api_key=KEY), BASE,
                        replica.app[MODEL].tokenizer)

    async def ask():
        text = await judge.complete(MESSAGES, 0.0, 8, 1)
        lps = await judge.teacher_logprobs(turn["prompt_ids"], choice["completion_ids"])
        return text, lps

    text, lps = asyncio.run(ask())
    judge.close()
    assert text.strip() == r.choices[0].message.content.strip()  # the reply drops a lead space
    assert len(lps) == len(choice["logprobs"])
    assert max(abs(a - b) for a, b in zip(lps, choice["logprobs"])) < 1e-3


def test_published_sampler_weights_serve_new_requests(learner, replica):
    """The remote trainer's sync (`publish_sampler`): new requests sample the saved sampler
    weights on the service and record the new adapter version. (After the tests that compare
    with the base model: the replica serves these weights from here on.)"""
    from test_tinker import TEXT, sft_datum

    eos = sorted(replica.app[MODEL].tokenizer.eos_token_ids)
    sc = tinker.ServiceClient(base_url=learner.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    for _ in range(2):
        tc.forward_backward([sft_datum(ids) for ids in TEXT], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("h3-v1").result().path
    replica.app[ENGINE].publish_sampler(path, 1)
    assert requests.get(replica.url + "/healthz").json()["adapter_version"] == 1

    replica.client().chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8,
                                             seed=11, extra_headers={"X-Session-Id": "s-v1"})
    choice = turn_of(replica.data_dir, "s-v1")["choices"][0]
    assert choice["adapter_versions"] == [1] * len(choice["completion_ids"])
    prompt = types.ModelInput.from_ints(turn_of(replica.data_dir, "s-v1")["prompt_ids"])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=eos)
    trained = sc.create_sampling_client(model_path=path).result().sample(
        prompt, 1, params).result().sequences[0]
    base = sc.create_sampling_client(base_model=BASE).result().sample(
        prompt, 1, params).result().sequences[0]
    assert choice["completion_ids"] == list(trained.tokens)
    assert choice["logprobs"] == [float(x) for x in trained.logprobs]
    assert choice["logprobs"] != [float(x) for x in base.logprobs]  # the weights did change


def test_scorer_judges_and_teaches_on_the_service(replica):
    """With --sampler tinker the judge and the teacher default to the service's base model
    (there are no local weights): a turn with a next state gets the service's votes."""
    from rlproxy.pipeline import make_judges
    from rlproxy.scoring.judges import RemoteJudge

    judge, teacher, made = make_judges(replica.settings, replica.app[MODEL], replica.app[ENGINE])
    assert isinstance(judge, TinkerJudge) and teacher is judge and made == [judge]
    mixed = replica.settings.model_copy(deep=True)
    mixed.remote.sampler, mixed.scoring.judge_url = "local", "http://127.0.0.1:9/v1"
    mixed.scoring.teacher_url = "tinker"
    judge, teacher, made = make_judges(mixed, replica.app[MODEL], replica.app[ENGINE])
    assert isinstance(judge, RemoteJudge) and isinstance(teacher, TinkerJudge)
    for backend in made:  # nothing was asked of them
        if isinstance(backend, TinkerJudge):
            backend.close()

    c, head = replica.client(), {"X-Session-Id": "sess-score"}
    first = c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=6,
                                      extra_headers=head)
    c.chat.completions.create(model=BASE, max_tokens=2, extra_headers=head, messages=[
        *MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And about the mountains?"}])
    path, deadline = replica.data_dir / "prm_scores.jsonl", time.monotonic() + 30
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        scored = [x for x in lines if x.get("session_id") == "sess-score"]
        if scored:
            break
        assert time.monotonic() < deadline, "the first turn was not scored"
        time.sleep(0.2)
    line = scored[0]
    assert line["votes"] and all(v["error"] is None and isinstance(v["text"], str)
                                 for v in line["votes"])
    # (the tiny model's hint answers are never valid hints, so its teacher log-probs are
    # checked directly, in test_judge_and_teacher_on_the_service)


def test_parameters_the_service_cannot_apply_are_a_400(replica):
    c = replica.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=4,
                                  presence_penalty=0.5)
    assert "presence_penalty" in str(e.value) and "--sampler tinker" in str(e.value)
    assert requests.get(replica.url + "/healthz").json()["status"] == "ok"  # no outage


def test_start_up_errors(learner, tmp_path):
    # a wrong key: `rlproxy serve` exits 2 with one line saying what to change
    env = {**server_env(), "TINKER_API_KEY": "tml-wrong", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        serve_command("--sampler", "tinker", "--no-train", "--tinker-url", learner.url,
                      port=free_port(), data_dir=tmp_path / "wrong"), env=env,
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rlproxy: --sampler tinker:") and "API key" in last, last
    # a base model the service does not have
    settings = make_settings(tmp_path / "base", sampler="tinker", tinker_url=learner.url,
                             tinker_api_key=KEY, tinker_base_model="no-such-model")
    with pytest.raises(ValueError, match="no base model 'no-such-model'"):
        with ServerThread(settings):
            pass
    # --sampler tinker has no weights to train locally
    with pytest.raises(ValueError, match="--sampler tinker"):
        make_settings(tmp_path / "t", sampler="tinker", train=True)


def test_learner_away_and_back(learner, replica):
    """Last: it restarts the learner."""
    c = replica.client()
    learner.stop()
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=4)
    assert e.value.status_code == 503 and "Tinker service" in str(e.value)
    assert e.value.response.headers["Retry-After"]
    health = requests.get(replica.url + "/healthz")  # degraded, not dead: no liveness restart
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert "Tinker service" in health.json()["error"]
    assert health.json()["engine"]["service_error"]
    tic = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:  # refused at once while it is away
        c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=4)
    assert e.value.status_code == 503 and time.monotonic() - tic < 1.0
    assert e.value.response.headers["Retry-After"] and "Tinker service" in str(e.value)
    assert e.value.body["code"] == "sampler_unavailable"

    learner.start()  # the same port, a fresh process: every session it had is gone
    deadline = time.monotonic() + 30
    while requests.get(replica.url + "/healthz").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the replica did not see the learner come back"
        time.sleep(0.2)
    r = c.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=4, seed=3)
    assert r.choices[0].message.content is not None
