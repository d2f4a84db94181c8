"""The `rlproxy` command's offline paths, run as a user would: train --from, fuse, records tail."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest

from rlproxy.cli import main
from rlproxy.model import load_serving_model
from rlproxy.settings import ModelSettings, load_settings
from conftest import ServerThread, make_settings, read_records


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A data dir with real recorded, scored and released turns (reward from a function)."""
    data = tmp_path_factory.mktemp("recorded")
    settings = make_settings(data, judge=False, at_least_one=False,
                             reward_functions=["test_trainer:target_reward"])
    with ServerThread(settings, load_serving_model(ModelSettings())) as s:
        c = s.client()
        for i in range(8):
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=10,
                seed=i, extra_headers={"X-Session-Id": f"rec-{i}", "X-Session-Done": "1"})
        import time
        deadline = time.time() + 30
        while len([r for r in read_records(data, "prm_scores.jsonl")
                   if r["kind"] == "release"]) < 8:
            assert time.time() < deadline
            time.sleep(0.1)
    return data


def test_offline_train_then_fuse(recorded, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["train", "--from", str(recorded), "--data-dir", str(out), "--batch-size", "4",
               "--learning-rate", "1e-3", "--log-level", "WARNING"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "8 turns, 2 steps" in printed
    steps = read_records(out, "training.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(s["turns"] == 4 for s in steps)
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "adapters.safetensors").exists()

    fused_dir = tmp_path / "fused"
    assert main(["fuse", "--adapter", str(ckpt), "--out", str(fused_dir)]) == 0
    fused, tok = mlx_lm.load(str(fused_dir))
    base = load_serving_model(ModelSettings())
    with_adapter, _ = mlx_lm.load(base.source, adapter_path=str(ckpt))
    ids = mx.array(tok.encode("fused weights equal base plus adapter"))[None]
    assert mx.allclose(fused(ids), with_adapter(ids), atol=1e-4).item()
    assert not mx.allclose(fused(ids), base.model(ids), atol=1e-4).item()  # it did change


def test_train_from_a_dir_without_scores_fails_clearly(tmp_path, capsys):
    assert main(["train", "--from", str(tmp_path), "--data-dir", str(tmp_path / "o")]) == 1
    assert "no scored turns" in capsys.readouterr().err


def test_records_tail_prints_turns(recorded):
    out = subprocess.run([sys.executable, "-m", "rlproxy.cli", "records", "tail", "--data-dir",
                          str(recorded), "--session", "rec-3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("rec-3 #0 main") == 1
    assert "user: hello 3" in out.stdout and "(no next state: session_done)" in out.stdout
    assert "rec-4" not in out.stdout


def test_bad_settings_say_what_to_fix(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[nonsense]\nx = 1\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "unknown section [nonsense]" in capsys.readouterr().err
    assert main(["serve", "--kv-bits", "3", "--data-dir", str(tmp_path)]) == 2
    assert "kv_bits must be 4 or 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="config file .* does not exist"):
        load_settings({}, tmp_path / "missing.toml", environ={})
    env = load_settings({}, environ={"RLPROXY_API_KEY": "k", "RLPROXY_PORT": "9001",
                                     "RLPROXY_SERVED_MODEL_NAME": "a, b"})
    assert (env.server.api_key, env.server.port, env.server.served_model_name) == \
        ("k", 9001, ["a", "b"])
    cfg.write_text("[server]\nport = 7000\n[trainer]\nlearning_rate = 0.5\n")
    merged = load_settings({"port": 7001}, cfg, environ={"RLPROXY_LEARNING_RATE": "0.25"})
    assert merged.server.port == 7001  # flag beats file
    assert merged.trainer.learning_rate == 0.25  # env beats file


def test_example_config_lists_every_setting_with_its_default():
    """deploy/rlproxy.example.toml names every field of every section, in that section, and
    every value it sets is the field's default, so the example cannot drift from settings.py."""
    import re
    from pathlib import Path

    from rlproxy.settings import SECTIONS, Settings

    example = Path(__file__).resolve().parent.parent / "deploy" / "rlproxy.example.toml"
    loaded = load_settings(config_file=example, environ={})  # unknown fields would raise here
    defaults = Settings()
    # paths that depend on the machine or the checkout: shown commented out, never set
    machine = {"data_dir", "prm_prompts"}
    named: dict[str, dict[str, bool]] = {}  # section -> field -> set (True) or commented out
    section = None
    for line in example.read_text().splitlines():
        if m := re.match(r"\[(\w+)\]", line):
            section = m[1]
            named[section] = {}
        elif section and (m := re.match(r"(#\s*)?(\w+)\s*=", line)):
            named[section][m[2]] = m[1] is None
    assert list(named) == list(SECTIONS)
    for name, cls in SECTIONS.items():
        assert set(named[name]) == set(cls.model_fields), f"[{name}] fields differ"
        for field, info in cls.model_fields.items():
            default = getattr(getattr(defaults, name), field)
            assert getattr(getattr(loaded, name), field) == default, f"{name}.{field}"
            # a value TOML can hold must be set, so that the comparison above checks it
            must_set = default is not None and field not in machine
            assert named[name][field] == must_set, f"{name}.{field} set={named[name][field]}"
