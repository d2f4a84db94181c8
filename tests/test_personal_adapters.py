"""Personal adapters (pipeline.py `Adapters`): a request names one with `MODEL:NAME` or the
X-RL-Adapter header; each has its own sessions, records, scores, trainer and checkpoints under
<data_dir>/adapters/NAME/, is served by name in the live batch (serving/personal.py,
serving/named.py), and learns only from its own turns. The real app on a real port, the openai
SDK, the tiny model, the demo's verifiable reward."""

from __future__ import annotations

import random
import re
import time

import mlx.core as mx
import openai
import pytest
import requests

from rlproxy import paths
from rlproxy.demo import run as demo
from conftest import ServerThread, read_records
from demo_agent import training_settings

QUESTION = [{"role": "user", "content": "Name three colours of the sea at dusk."}]


def greedy(client, model: str, headers=None):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                       temperature=0, logprobs=True,
                                       extra_headers={"X-RL-Opt-Out": "1", **(headers or {})})
    return [t.logprob for t in r.choices[0].logprobs.content], r


def session(client, model: str, sid: str, seed: int, headers=None) -> None:
    """The demo's two-turn session (a tool result answered, then a follow-up), done."""
    messages = demo.opening(random.Random(seed))
    for step in (0, 1):
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, seed=seed * 2 + step,
            tools=demo.TOOLS, extra_headers={"X-Session-Id": sid, **(headers or {}),
                                             **({"X-Session-Done": "1"} if step else {})})
        messages = messages + [{"role": "assistant", "content": r.choices[0].message.content
                                or ""}, {"role": "user",
                                         "content": "Thanks. What will it be tomorrow?"}]


def adapters(url: str) -> dict:
    return requests.get(url + "/healthz").json()["adapters"]


def wait_version(url: str, name: str, version: int, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        a = adapters(url)["adapters"].get(name)
        assert a is None or not a["trainer"]["error"], a
        if a is not None and a["version"] >= version:
            return a
        assert time.monotonic() < deadline, adapters(url)
        time.sleep(0.2)


@pytest.mark.slow
def test_each_adapter_learns_from_its_own_sessions_only(own, tmp_path):
    with ServerThread(training_settings(tmp_path), own) as s:
        c = s.client()
        served = c.models.list().data[0].id
        base, _ = greedy(c, "m")
        session(c, f"{served}:alice", "a-1", 1)  # by the model's name
        session(c, "m", "a-2", 2, {"X-RL-Adapter": "Alice"})  # by header, any case
        alice = wait_version(s.url, "alice", 1)
        session(c, "m", "a-3", 3, {"X-RL-Adapter": "alice"})  # sampled by her version 1
        bob_before, r = greedy(c, "m", {"X-RL-Adapter": "bob"})  # made now, untrained
        assert r  # served
        alice_lps, _ = greedy(c, f"{served}:alice")
        default_after, _ = greedy(c, "m")
        health = adapters(s.url)
        trainer = requests.get(s.url + "/healthz").json()["trainer"]
        # the actions, on alice's adapter: never on the default's
        as_alice = {"X-RL-Adapter": "alice"}
        paused = requests.post(s.url + "/v1/training/pause", headers=as_alice).json()
        paused_health = adapters(s.url)["adapters"]["alice"]["trainer"]["paused"]
        default_paused = requests.get(s.url + "/healthz").json()["trainer"]["paused"]
        requests.post(s.url + "/v1/training/resume", headers=as_alice).raise_for_status()
        saved = requests.post(s.url + "/v1/checkpoints", headers=as_alice).json()
        rolled = requests.post(s.url + "/v1/adapters/1/serve", headers=as_alice).json()
        zipped = requests.get(s.url + "/ui/api/adapters/1.zip", headers=as_alice)
        default_version = requests.get(s.url + "/healthz").json()["adapter_version"]
        metrics = requests.get(s.url + "/metrics").text
        from rlproxy.ops.status import render
        status = render(requests.get(s.url + "/healthz").json(), None)
        listed = [m.id for m in c.models.list().data]
    # alice trained on her two sessions; the default adapter and bob trained on nothing
    assert alice["trainer"]["step"] >= 1 and trainer["step"] == 0
    assert set(health["adapters"]) == {"alice", "bob"}
    assert health["adapters"]["bob"]["version"] == 0
    assert paused["paused"] and paused_health and not default_paused
    assert saved["path"].startswith(str(tmp_path / paths.ADAPTERS / "alice"))
    assert rolled["checkpoint_step"] == 1 and rolled["served_version"] == \
        rolled["adapter_version"] > alice["version"]
    assert rolled["checkpoint"].startswith(str(tmp_path / paths.ADAPTERS / "alice"))
    assert default_version == 0 and zipped.status_code == 200
    import io
    import zipfile
    assert "step_000001/adapters.safetensors" in zipfile.ZipFile(io.BytesIO(
        zipped.content)).namelist()
    assert listed == [served, f"{served}:alice", f"{served}:bob"]
    assert 'rlproxy_personal_adapter_version{adapter="bob"} 0.0' in metrics
    version = re.search(r'rlproxy_personal_adapter_version\{adapter="alice"\} (\S+)', metrics)
    steps = re.search(r'rlproxy_personal_train_steps_total\{adapter="alice"\} (\S+)', metrics)
    assert float(version[1]) >= 1 and float(steps[1]) >= 1, metrics
    assert re.search(r"adapter   alice: version [1-9]\d*, 0 open sessions, step [1-9]", status)
    assert "adapter   bob: version 0, 0 open sessions, step 0, 0 turns trained" in status
    assert default_after == pytest.approx(base, abs=1e-4)
    assert bob_before == pytest.approx(base, abs=2.5e-4)  # a fresh adapter is the base
    assert max(abs(a - b) for a, b in zip(alice_lps, base)) > 1e-4
    # her records are in her folder, every turn of them; the default's files have none
    mine = tmp_path / paths.ADAPTERS / "alice"
    turns = read_records(mine)
    assert {t["session_id"] for t in turns} == {"a-1", "a-2", "a-3"} and len(turns) == 6
    assert not [t for t in read_records(tmp_path) if t["session_id"].startswith("a-")]
    steps = [ln for ln in read_records(mine, "training.jsonl") if ln["kind"] == "step"]
    assert steps and {u for ln in steps for u in ln["uids"]} <= {t["uid"] for t in turns}
    assert not read_records(tmp_path, "training.jsonl")
    assert paths.kept_checkpoint(mine / paths.CHECKPOINTS, 1) is not None
    # the tokens of alice's turns carry the version of her adapter that sampled them
    versions = {t["session_id"]: set(t["choices"][0]["adapter_versions"]) for t in turns}
    assert versions["a-1"] == {0} and min(versions["a-3"]) >= 1


def alice_trains_and_leaves_a_session_open(c, url: str) -> list[float]:
    """alice's session trains her a step; then one turn of session open-1, left open: her
    greedy log-probs after that step."""
    session(c, "m", "a-1", 1, {"X-RL-Adapter": "alice"})
    wait_version(url, "alice", 1)
    trained, _ = greedy(c, "m", {"X-RL-Adapter": "alice"})
    c.chat.completions.create(model="m", messages=QUESTION, max_tokens=4,
                              extra_headers={"X-RL-Adapter": "alice", "X-Session-Id": "open-1"})
    return trained


@pytest.mark.slow
def test_an_adapter_comes_back_after_a_restart_with_its_sessions_and_weights(tmp_path):
    from conftest import tiny_copy

    settings = training_settings(tmp_path)
    settings.trainer.resume = True  # a restart serves the last checkpoint, as by default
    with ServerThread(settings, tiny_copy()) as s:
        c = s.client()
        trained = alice_trains_and_leaves_a_session_open(c, s.url)
    from rlproxy.cli import main  # its folder exports as any data dir does
    out = tmp_path / "exported"
    assert main(["export", "--data-dir", str(tmp_path / paths.ADAPTERS / "alice"), "--model",
                 "tiny", "--format", "mlx", "--out", str(out)]) == 0
    newest = sorted((tmp_path / paths.ADAPTERS / "alice" / paths.CHECKPOINTS).glob("step_*"))
    exported, kept = (mx.load(str(d / "adapters.safetensors")) for d in (out, newest[-1]))
    assert exported.keys() == kept.keys() and all(
        mx.array_equal(exported[k], kept[k]).item() for k in kept)
    with ServerThread(settings, tiny_copy()) as s:
        resting = adapters(s.url)  # on disk until its first request
        again, _ = greedy(s.client(), "m", {"X-RL-Adapter": "alice"})
        health = adapters(s.url)
        pending = requests.get(s.url + "/v1/sessions/open-1",
                               headers={"X-RL-Adapter": "alice"})
    off = training_settings(tmp_path)  # training off: it serves its newest checkpoint
    off.trainer.train = False
    with ServerThread(off, tiny_copy()) as s:
        frozen, _ = greedy(s.client(), "m", {"X-RL-Adapter": "alice"})
    assert frozen == pytest.approx(trained, abs=1e-4)
    assert resting["resting"] == ["alice"] and resting["adapters"] == {}
    assert health["adapters"]["alice"]["version"] >= 1 and health["resting"] == []
    assert again == pytest.approx(trained, abs=1e-4)
    assert pending.status_code == 200 and pending.json()["id"] == "open-1"


def test_names_the_limit_and_fixed_names_are_refused_in_the_apis_shape(tiny, tmp_path):
    from conftest import make_settings

    # an adapter on disk that cannot be made: its requests get 503, the server and others serve
    (tmp_path / paths.ADAPTERS / "carol" / paths.CONVERSATIONS).mkdir(parents=True)
    with ServerThread(make_settings(tmp_path, max_adapters=2), tiny) as s:
        c = s.client()
        served = c.models.list().data[0].id
        with pytest.raises(openai.InternalServerError) as broken:
            greedy(c, "m", {"X-RL-Adapter": "carol"})
        assert broken.value.body["code"] == "adapter_unavailable"
        assert "IsADirectoryError" in str(broken.value)
        with pytest.raises(openai.BadRequestError) as bad:
            greedy(c, "m", {"X-RL-Adapter": "no/slashes"})
        assert bad.value.body["param"] == "X-RL-Adapter"
        with pytest.raises(openai.BadRequestError) as bad:
            greedy(c, f"{served}:bad.name")
        assert bad.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError) as two:
            greedy(c, f"{served}:alice", {"X-RL-Adapter": "bob"})
        assert "names adapter 'alice' and X-RL-Adapter 'bob'" in str(two.value)
        with pytest.raises(openai.NotFoundError) as step:  # reads a checkpoint: makes nothing
            greedy(c, f"{served}:alice@1")
        assert "no adapter named 'alice'" in str(step.value)
        assert greedy(c, f"{served}:default")[0] == greedy(c, "m")[0]  # the default adapter
        greedy(c, f"{served}:alice")
        with pytest.raises(openai.PermissionDeniedError) as full:  # not retried by the SDKs
            greedy(c, f"{served}:bob")
        assert full.value.body["code"] == "adapter_limit" and "--max-adapters 2" in str(
            full.value)
        greedy(c, "llama3:8b")  # not a name this server answers to: the default adapter
        h = adapters(s.url)
        assert set(h["adapters"]) == {"alice"} and "IsADirectoryError" in h["failed"]["carol"]
        # one session id in two adapters: feedback must say which
        for adapter in ("alice", "default"):
            c.chat.completions.create(model="m", messages=QUESTION, max_tokens=2,
                                      extra_headers={"X-Session-Id": "same",
                                                     "X-RL-Adapter": adapter})
        body = {"session_id": "same", "turn": "last", "reward": 1.0}
        ambiguous = requests.post(s.url + "/v1/feedback", json=body)
        named = requests.post(s.url + "/v1/feedback", json=body,
                              headers={"X-RL-Adapter": "alice"})
        pause = requests.post(s.url + "/v1/training/pause", headers={"X-RL-Adapter": "alice"})
        zero = requests.post(s.url + "/v1/checkpoints", headers={"X-RL-Adapter": "nobody"})
    assert ambiguous.status_code == 409 and ambiguous.json()["error"]["code"] == \
        "ambiguous_session"
    assert named.status_code == 200, named.text
    assert pause.status_code == 409 and pause.json()["error"]["code"] == "training_off"
    assert zero.status_code == 404 and zero.json()["error"]["code"] == "adapter_not_found"
    assert not (tmp_path / paths.ADAPTERS / "bob").exists()
    with ServerThread(make_settings(tmp_path / "fixed", adapters=["carol"],
                                    adapter_names="fixed"), tiny) as s:
        c = s.client()
        greedy(c, "m", {"X-RL-Adapter": "carol"})
        with pytest.raises(openai.NotFoundError) as unknown:
            greedy(c, "m", {"X-RL-Adapter": "dave"})
        assert unknown.value.body["code"] == "adapter_not_found"
        assert "carol" not in str(unknown.value)  # another user's name is not told
    with ServerThread(make_settings(tmp_path / "off", max_adapters=0), tiny) as s:
        with pytest.raises(openai.BadRequestError) as off:
            greedy(s.client(), "m", {"X-RL-Adapter": "erin"})
        assert off.value.body["code"] == "adapters_off" and "--max-adapters 0" in str(
            off.value)
        assert adapters(s.url) == {"enabled": False, "reason": "--max-adapters 0"}


def test_each_adapter_reuses_its_own_prefix_kv_and_no_one_elses(tiny, tmp_path):
    """A personal adapter's next turn restores the KV of its last one from the prefix cache,
    in a lineage of its own: another adapter's request with the same prompt prefills it all,
    and gives the tokens and log-probs of its own adapter, as from scratch."""
    from conftest import make_settings

    long = " ".join(f"word{i % 50}" for i in range(1200))  # ~1,200+ prompt tokens

    def ask(c, headers, tail=""):
        r = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": long + tail}], max_tokens=6,
            temperature=0, logprobs=True, extra_headers={"X-RL-Opt-Out": "1", **headers})
        return (r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content,
                [t.logprob for t in r.choices[0].logprobs.content])

    with ServerThread(make_settings(tmp_path), tiny) as s:
        c = s.client()
        alice = {"X-RL-Adapter": "alice"}
        first = ask(c, alice)
        time.sleep(0.5)  # its KV is written by the store's thread
        again = ask(c, alice, " Then say more.")
        bob = ask(c, {"X-RL-Adapter": "bob"}, " Then say more.")
        default = ask(c, {}, " Then say more.")
        cache = requests.get(s.url + "/healthz").json()["prefix_cache"]
    with ServerThread(make_settings(tmp_path / "none", prefix_cache=False), tiny) as s:
        scratch = ask(s.client(), {"X-RL-Adapter": "alice"}, " Then say more.")
    assert first[0] == 0 and again[0] > 1000, (first[0], again[0])
    assert bob[0] == 0 and default[0] == 0, (bob[0], default[0])
    assert cache["hits"] == 1 and cache["stores"] >= 3, cache
    # restored KV answers as prefilling it all did
    assert again[1] == scratch[1] and again[2] == pytest.approx(scratch[2], abs=1e-4)


@pytest.mark.slow
def test_an_idle_adapter_is_let_go_of_and_its_next_request_brings_it_back(tmp_path):
    from conftest import tiny_copy

    settings = training_settings(tmp_path)
    settings.trainer.resume = True
    settings.sessions.adapter_idle_s = 1.0
    with ServerThread(settings, tiny_copy()) as s:
        c = s.client()
        trained = alice_trains_and_leaves_a_session_open(c, s.url)
        deadline = time.monotonic() + 30
        while "alice" not in (h := adapters(s.url))["resting"]:
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        assert h["adapters"] == {}
        listed = [m.id for m in c.models.list().data]
        again, _ = greedy(c, "m", {"X-RL-Adapter": "alice"})  # brought back from disk
        back = adapters(s.url)
        pending = requests.get(s.url + "/v1/sessions/open-1", headers={"X-RL-Adapter": "alice"})
        # a paused adapter is kept loaded: its pause lives in its trainer, not on disk
        requests.post(s.url + "/v1/training/pause", headers={"X-RL-Adapter": "alice"})
        time.sleep(2.5)
        paused = adapters(s.url)
    assert listed[1:] == [f"{listed[0]}:alice"]  # still listed while it rests
    assert back["adapters"]["alice"]["version"] >= 1
    assert again == pytest.approx(trained, abs=1e-4)
    assert pending.status_code == 200 and pending.json()["open"]
    assert paused["resting"] == [] and paused["adapters"]["alice"]["trainer"]["paused"]
