"""A new user's first hour, on the real CLI as a process: start-up mistakes are one line (no
traceback, no model loaded, the right exit status), each model gets its own default data dir,
--no-train serves what was trained, and `rlproxy export` takes the adapter a running server
serves now, before any save interval has come round."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
import requests
from conftest import HELLO_PROMPT, HELLO_REPLY

from rlproxy.ops.served import Served, free_port, server_env
from rlproxy.paths import (CHECKPOINTS, LOCK, default_data_dir, model_dir_name,
                           serving_url)
from rlproxy.serving.model_fetch import model_cache_dir
from rlproxy.training.checkpoints import save_checkpoint

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def rlproxy(*args: str, home: Path | None = None, timeout: float = 60):
    """`rlproxy ARGS` as a process: (exit status, stderr, seconds it took)."""
    env = server_env()
    env["HF_HUB_OFFLINE"] = "1"  # this machine has no hub: say so at once, as a user's would
    if home is not None:
        env["HOME"] = str(home)
        env["RLPROXY_CACHE_DIR"] = str(model_cache_dir().parent)  # the tiny model, built once
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rlproxy.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr, time.monotonic() - t0


def one_line(stderr: str) -> str:
    """The error line; fails on a traceback, a model load or anything but that line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr and "loaded the" not in stderr, stderr
    errors = [ln for ln in lines if ln.startswith("rlproxy: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_an_unknown_model_is_one_line_listing_what_is_accepted(tmp_path):
    data = tmp_path / "data"
    code, err, took = rlproxy("serve", "--model", "nonexistent", "--data-dir", str(data))
    line = one_line(err)
    assert code == 2, err
    for accepted in ("smollm2-135m-instruct", "tiny or small", ".gguf file", "model directory",
                     "hub id", "cannot be reached", "HF_HUB_OFFLINE"):
        assert accepted in line, line
    assert took < 10, took  # no hub retries (measured ~0.7 s; a loaded machine is slower)
    assert not data.exists()  # it stopped before taking the data dir
    # a near miss of a name is named; a path that is not there says so
    code, err, _ = rlproxy("serve", "--model", "smollm2-135m", "--data-dir", str(data))
    assert code == 2 and "Did you mean smollm2-135m-instruct?" in one_line(err), err
    code, err, _ = rlproxy("serve", "--model", "./no/such/folder", "--data-dir", str(data))
    assert code == 2 and "no such directory" in one_line(err), err
    code, err, _ = rlproxy("serve", "--model", "tiny", "--adapter", str(tmp_path / "nope"),
                           "--data-dir", str(data))
    assert code == 2 and "--adapter" in one_line(err) and "no such folder" in err, err
    assert not data.exists()


def test_a_busy_port_is_found_before_any_model_loads(tmp_path):
    data = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err, took = rlproxy("serve", "--model", "tiny", "--port", str(port),
                                  "--data-dir", str(data))
    line = one_line(err)
    assert code == 3, err  # in use: the documented status for a busy port or data dir
    assert f"port {port}" in line and "in use" in line and "--port" in line, line
    assert took < 10, took
    assert not data.exists()


def test_a_mistyped_flag_shows_serves_usage_and_the_closest_flag(tmp_path):
    code, err, _ = rlproxy("serve", "--modle", "tiny")
    assert code == 2, err
    assert "usage: rlproxy serve" in err and "did you mean --model?" in err, err
    assert "usage: rlproxy [-h]" not in err  # not the top level's
    code, err, _ = rlproxy("export", "--format", "peft", "--out", str(tmp_path / "x"),
                           "--stpe", "3")
    assert code == 2 and "usage: rlproxy export" in err and "did you mean --step?" in err, err


def test_each_model_gets_its_own_default_data_dir(tmp_path):
    home = tmp_path / ".rlproxy"
    assert default_data_dir("tiny", home) == home / "tiny"
    assert default_data_dir("Qwen/Qwen3-0.6B", home) == home / "Qwen--Qwen3-0.6B"
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    a.mkdir(parents=True), b.mkdir(parents=True)
    assert model_dir_name(str(a)) != model_dir_name(str(b))  # same name, other folder
    assert model_dir_name(str(a)).startswith("model-")
    # a data dir from before per-model dirs stays the one of the model it trained ...
    save_checkpoint(home / CHECKPOINTS, 3, 3, {"w": mx.zeros((1,))}, {}, {},
                    {"model": {"model": "small"}})
    assert default_data_dir("small", home) == home
    assert default_data_dir("tiny", home) == home / "tiny"  # ... and not of another
    # ... and with records but no checkpoint, of the model that was the default
    other = tmp_path / "other"
    other.mkdir()
    (other / "conversations.jsonl").write_text("")
    assert default_data_dir("smollm2-135m-instruct", other) == other
    assert default_data_dir("tiny", other) == other / "tiny"


def start(args: list[str], log: Path, home: Path | None = None) -> Served:
    """`rlproxy serve --model tiny ARGS` (its data dir in ARGS, or HOME's default), healthy."""
    env = {} if home is None else {"HOME": str(home),
                                   "RLPROXY_CACHE_DIR": str(model_cache_dir().parent)}
    return Served(None, "--log-level", "INFO", *args, log=log, env=env, python_path=(TESTS,))


def hello(url: str) -> str:
    r = requests.post(url + "/v1/chat/completions", headers={"X-Session-Done": "1"}, json={
        "model": "m", "messages": HELLO_PROMPT, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_switching_models_on_the_default_data_dir_just_works(tmp_path):
    """`serve` on one model, then `serve --model tiny`: the second is not refused by the first's
    checkpoint, and each keeps its own records under ~/.rlproxy/<model>/."""
    home = tmp_path / "home"
    legacy = home / ".rlproxy"  # another model trained here, before per-model data dirs
    save_checkpoint(legacy / CHECKPOINTS, 10, 10, {"w": mx.zeros((1,))}, {}, {},
                    {"model": {"model": "small"}})
    with start(["--no-train"], tmp_path / "server.log", home=home) as server:
        health = requests.get(server.url + "/healthz").json()
        assert health["data_dir"] == str(legacy / "tiny"), health
        assert serving_url(legacy / "tiny") == server.url  # `rlproxy export` finds it by its lock
        hello(server.url)
    assert (legacy / "tiny" / "conversations.jsonl").stat().st_size > 0
    assert not (legacy / "conversations.jsonl").exists()  # the other model's dir untouched
    assert serving_url(legacy / "tiny") is None and (legacy / "tiny" / LOCK).exists()


def test_no_train_serves_the_data_dirs_newest_adapter(taught_adapter, tmp_path):
    data = tmp_path / "data"
    weights = mx.load(str(taught_adapter / "adapters.safetensors"))
    config = json.loads((taught_adapter / "adapter_config.json").read_text())
    newest = save_checkpoint(data / CHECKPOINTS, 2, 2, weights, {}, config,
                             {"model": {"model": "tiny"}})
    log = tmp_path / "server.log"
    with start(["--no-train", "--data-dir", str(data)], log) as server:
        assert requests.get(server.url + "/healthz").json()["adapter"] == str(newest)
        assert hello(server.url) == HELLO_REPLY  # what the checkpoint was taught
    assert f"serving the adapter trained in this data dir, checkpoint {newest}" in \
        log.read_text()
    with start(["--no-train", "--data-dir", str(data), "--adapter", "base"], log) as server:
        assert requests.get(server.url + "/healthz").json()["adapter"] is None
        assert hello(server.url) != HELLO_REPLY  # the base model's own gibberish


@pytest.mark.slow
def test_export_takes_the_adapter_a_running_server_serves_before_any_checkpoint(tmp_path):
    data, out = tmp_path / "data", tmp_path / "export"
    # before any step: a clear refusal, one line
    server = start(["--data-dir", str(data), "--batch-size", "1", "--no-judge",
                    "--no-at-least-one", "--learning-rate", "1e-3",
                    "--reward-function", "test_trainer:target_reward"], tmp_path / "server.log")
    url = server.url
    try:
        code, err, _ = rlproxy("export", "--data-dir", str(data), "--model", "tiny",
                               "--format", "mlx", "--out", str(out))
        assert code == 2 and "no optimizer step yet" in one_line(err), err
        deadline, k = time.time() + 180, 0
        while time.time() < deadline:  # turns that close their sessions: scored, trained
            trainer = requests.get(url + "/healthz").json()["trainer"]
            if trainer["step"] >= 2:
                break
            if k < 16 and trainer["untrained"] == 0:
                r = requests.post(url + "/v1/chat/completions", headers={
                    "X-Session-Id": f"s{k}", "X-Session-Done": "1"}, json={
                    "model": "m", "messages": [{"role": "user", "content": f"turn {k}"}],
                    "max_tokens": 16, "seed": k})
                assert r.status_code == 200, r.text
                k += 1
            time.sleep(0.3)
        assert trainer["step"] >= 2, trainer
        assert not (data / CHECKPOINTS).exists() or not any((data / CHECKPOINTS).iterdir())
        code, err, _ = rlproxy("export", "--data-dir", str(data), "--model", "tiny",
                               "--format", "mlx", "--out", str(out))
        assert code == 0, err
        assert "wrote checkpoint" in err, err
        exported = mx.load(str(out / "adapters.safetensors"))
        assert any(mx.abs(v).max().item() > 0 for k, v in exported.items() if "lora_b" in k)
        (saved,) = (data / CHECKPOINTS).iterdir()  # written on demand
        state = json.loads((saved / "trainer_state.json").read_text())
        assert state["step"] >= 2
        assert state["adapter_version"] == requests.get(url + "/healthz").json()[
            "adapter_version"]
    finally:
        server.stop()
    # with the server gone: the newest checkpoint, the same adapter
    code, err, _ = rlproxy("export", "--data-dir", str(data), "--model", "tiny",
                           "--format", "mlx", "--out", str(tmp_path / "again"))
    assert code == 0, err
    again = mx.load(str(tmp_path / "again" / "adapters.safetensors"))
    assert all(mx.array_equal(again[k], v).item() for k, v in exported.items())


def test_an_explicit_data_dir_of_another_model_is_still_refused_in_one_line(tmp_path):
    data = tmp_path / "data"
    save_checkpoint(data / CHECKPOINTS, 10, 10, {"w": mx.zeros((1,))}, {}, {},
                    {"model": {"model": "small"}})
    code, err, _ = rlproxy("serve", "--model", "tiny", "--data-dir", str(data), "--port",
                           str(free_port()), timeout=120)
    assert code == 2, err
    assert "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("rlproxy: ")]
    assert len(line) == 1 and "another model" in line[0] and "--data-dir" in line[0], err
