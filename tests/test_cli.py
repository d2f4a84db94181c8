"""The `rlproxy` command's offline paths, run as a user would: train --from, fuse, records tail."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
import requests

from rlproxy.cli import build_parser, flags_from, main
from rlproxy.ops.served import Served
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import SECTIONS, ModelSettings, Settings, load_settings
from conftest import read_records


def test_offline_train_then_fuse(recorded, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["train", "--from", str(recorded), "--model", "tiny", "--data-dir", str(out),
               "--batch-size", "4",
               "--learning-rate", "1e-3", "--log-level", "WARNING"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "8 turns, 2 steps" in printed
    steps = read_records(out, "training.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(s["turns"] == 4 for s in steps)
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "adapters.safetensors").exists()

    fused_dir = tmp_path / "fused"
    assert main(["fuse", "--model", "tiny", "--adapter", str(ckpt), "--out", str(fused_dir)]) == 0
    fused, tok = mlx_lm.load(str(fused_dir))
    base = load_serving_model(ModelSettings(model="tiny"))
    with_adapter, _ = mlx_lm.load(base.source, adapter_path=str(ckpt))
    ids = mx.array(tok.encode("fused weights equal base plus adapter"))[None]
    assert mx.allclose(fused(ids), with_adapter(ids), atol=1e-4).item()
    assert not mx.allclose(fused(ids), base.model(ids), atol=1e-4).item()  # it did change


def test_train_seed_gives_the_same_adapter_from_the_same_records(recorded, tmp_path):
    """--train-seed fixes the LoRA initialisation (the records fix the order turns train in):
    two runs with seed 0 write the same adapter; seed 1 another."""
    def adapter(seed: int, where: str) -> dict:
        out = tmp_path / where
        assert main(["train", "--from", str(recorded), "--model", "tiny", "--data-dir", str(out),
                     "--batch-size", "4", "--learning-rate", "1e-3", "--train-seed", str(seed),
                     "--log-level", "WARNING"]) == 0
        return mx.load(str(out / "checkpoints" / "step_000002" / "adapters.safetensors"))

    first, again, other = adapter(0, "a"), adapter(0, "b"), adapter(1, "c")
    assert first.keys() == again.keys() == other.keys() and first
    for k in first:
        distance = (mx.linalg.norm(first[k] - again[k]) / mx.linalg.norm(first[k])).item()
        assert distance <= 1e-6, (k, distance)
    assert any(not mx.allclose(first[k], other[k]).item() for k in first if "lora_a" in k)


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
    with pytest.raises(SystemExit) as exited:  # argparse knows the choices: Literal[0, 4, 8]
        main(["serve", "--kv-bits", "3", "--data-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "--kv-bits: invalid choice: 3 (choose from 0, 4, 8)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_bits: Input should be 0, 4 or 8"):
        load_settings({}, environ={"RLPROXY_KV_BITS": "3"})
    assert load_settings({}, environ={"RLPROXY_KV_BITS": "8"}).cache.kv_bits == 8  # text -> int
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


# ---- flags generated from the settings fields ----

# Every flag `rlproxy serve` had before they were generated: the README, tests, benches and
# users' scripts spell them so.
OLD_FLAGS = """--config --host --port --api-key --max-request-mb --tinker-max-models
--served-model-name --strict-model-names --model --adapter --lora-rank
--lora-scale --lora-layers --quantize-bits --lora-keys --max-batch --default-max-tokens
--strict-max-tokens --reasoning-parser --data-dir --method --prm-m --prm-temperature
--prm-max-tokens --prm-max-context-chars --prm-prompts --w-opd --w-rl --at-least-one
--no-at-least-one --feedback-mode --reward-function --no-judge --judge-url --judge-model
--judge-api-key --teacher-url --no-train --loss-fn --eps-low --eps-high --dro-beta --kl-coef
--learning-rate --batch-size --train-epochs --max-context-tokens --prompt-grad
--train-chunk-tokens --train-memory-gb --grad-clip --baseline --save-interval
--keep-checkpoints --no-resume --duty-cycle --max-step-attempts --judge-timeout-s
--judge-retries --judge-concurrency --no-prefix-cache --prefix-cache-disk-limit-gb
--prefix-cache-memory-mb --kv-bits --kv-group-size --quantized-kv-start --kv-reuse-max-lag
--session-idle-timeout-s --no-fsync --responses-store-mb --metrics-public --log-level
--log-format""".split()

FIELDS = {name: info for cls in SECTIONS.values() for name, info in cls.model_fields.items()}


def other_value(name: str, info):
    """A valid value of the field other than its default, of the type the field holds."""
    default, kind = info.default, info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        return not default
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != default)
    if typing.get_origin(kind) is list:  # valid for every list field, reward functions too
        return ["alice", "bob"] if name == "adapters" else ["pkg.mod:one", "pkg.mod:two"]
    if kind is int:  # None (an optional count): any count its lower bound allows
        low = max((m.ge for m in info.metadata if hasattr(m, "ge")), default=0)
        return max(default or 0, low) + 1
    if kind is float:
        return default / 2 if default else 0.5
    if kind is Path:
        return Path("/tmp/rlproxy-flag-test")
    assert kind is str, f"{name}: a field of type {kind} needs a case here"
    return "x"


def argv_for(name: str, value) -> list[str]:
    """The command line a user types for this value, spelt by hand rather than by cli.py."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [part for item in value for part in (flag, item)]
    return [flag, str(value)]


def settings_from(argv: list[str], environ: dict[str, str] | None = None):
    """What `rlproxy serve ARGV` would run with: the same parse and merge as serve()."""
    args = build_parser().parse_args(["serve", *argv])
    return load_settings(flags_from(args), args.config, environ=environ or {})


def test_every_setting_has_a_flag_that_parses_to_its_type():
    chosen = {name: other_value(name, info) for name, info in FIELDS.items()}
    argv = [part for name, value in chosen.items() for part in argv_for(name, value)]
    for command in (["serve"], ["train", "--from", "/tmp/nowhere"]):
        args = build_parser().parse_args([*command, *argv])
        loaded = load_settings(flags_from(args), environ={})
        for name, value in chosen.items():
            got = getattr(getattr(loaded, next(s for s, c in SECTIONS.items()
                                               if name in c.model_fields)), name)
            assert got == value and type(got) is type(value), (command[0], name, got, value)
    # None-able and Literal[4, 8] fields: ints, not the text "4"
    parsed = settings_from(["--kv-bits", "4", "--quantize-bits", "8", "--max-kl", "0.05",
                            "--train-memory-gb", "3"])
    assert (parsed.cache.kv_bits, parsed.model.quantize_bits) == (4, 8)
    assert (parsed.trainer.max_kl, parsed.trainer.train_memory_gb) == (0.05, 3.0)
    with pytest.raises(SystemExit):  # argparse refuses what the Literal does not allow
        build_parser().parse_args(["serve", "--loss-fn", "nope"])


def test_old_flag_spellings_still_work(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    listed = set(re.findall(r"--[a-z0-9-]+", capsys.readouterr().out))
    assert not set(OLD_FLAGS) - listed, set(OLD_FLAGS) - listed
    s = settings_from(["--no-train", "--no-judge", "--no-prefix-cache", "--no-fsync",
                       "--no-resume", "--no-at-least-one", "--strict-model-names",
                       "--metrics-public", "--reward-function", "a:b", "--reward-function",
                       "c:d", "--served-model-name", "m1", "--served-model-name", "m2",
                       "--lora-keys", "self_attn.q_proj", "--lora-keys", "self_attn.v_proj"])
    assert not (s.trainer.train or s.scoring.judge or s.cache.prefix_cache or s.records.fsync
                or s.trainer.resume or s.scoring.at_least_one)
    assert s.server.strict_model_names and s.server.metrics_public
    assert s.scoring.reward_functions == ["a:b", "c:d"]
    assert s.server.served_model_name == ["m1", "m2"]
    assert s.model.lora_keys == ["self_attn.q_proj", "self_attn.v_proj"]
    # the plural spelling of the field works too; abbreviations do not (a new setting must
    # never make an abbreviation ambiguous)
    assert settings_from(["--reward-functions", "a:b"]).scoring.reward_functions == ["a:b"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--learning", "0.1"])


def test_help_shows_every_setting_with_its_default(capsys):
    """Each field's flag is in `serve --help` and `train --help` with its description (the one
    source of help text) and its default."""
    for command in (["serve"], ["train"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        # one block per option: from a line starting "  --" to the next such line
        blocks = {}
        for block in re.split(r"\n(?=  -)", out):
            option_strings = block.strip().split("\n")[0].split("  ")[0]
            for flag in re.findall(r"--[a-z0-9-]+", option_strings):
                blocks[flag] = " ".join(block.split())
        for name, info in FIELDS.items():
            flag = "--" + name.replace("_", "-")
            assert flag in blocks, f"{command[0]}: no {flag}"
            text = blocks[flag]
            assert info.description, f"{name} has no description in settings.py"
            assert " ".join(info.description.split())[:40] in text, name
            assert "default:" in text, f"{flag}: the help does not say the default"
            if info.default is None:  # "(default: None)" tells a user nothing
                assert "default:" in info.description, f"{name}: say what unset means"
            default = info.default
            if isinstance(default, bool):
                assert f"(default: {'on' if default else 'off'})" in text, text
            elif isinstance(default, (int, float, str)) and not isinstance(default, Path):
                assert f"(default: {default})" in text, text
    # spot checks, spelt out
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for expected in ("--port N port to listen on (0 picks a free one) (default: 8000)",
                     "--train, --no-train", "--kv-bits {0,4,8}", "(default: ~/.rlproxy/<model>/, one per --model)",
                     "--learning-rate NUM AdamW learning rate (default: 1e-05)",
                     "--max-queued-requests N", "--lr-schedule {constant,cosine,linear}"):
        assert expected in flat, expected


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path):
    cfg = tmp_path / "rlproxy.toml"
    cfg.write_text("[server]\nport = 7000\n[trainer]\nbatch_size = 2\ntrain = false\n"
                   "learning_rate = 0.5\n[cache]\nkv_bits = 4\n"
                   "[scoring]\nreward_functions = [\"a:toml\"]\n")
    env = {"RLPROXY_BATCH_SIZE": "3", "RLPROXY_TRAIN": "true", "RLPROXY_KV_BITS": "8",
           "RLPROXY_REWARD_FUNCTIONS": "a:env, b:env", "RLPROXY_PORT": "7002"}
    s = settings_from(["--config", str(cfg), "--port", "7001", "--no-train",
                       "--reward-function", "a:flag"], env)
    assert s.server.port == 7001  # flag > env > file
    assert s.trainer.train is False  # flag > env > file, for a --x/--no-x pair
    assert s.scoring.reward_functions == ["a:flag"]  # a repeated flag replaces the list
    assert s.trainer.batch_size == 3 and s.cache.kv_bits == 8  # env > file
    assert s.trainer.learning_rate == 0.5  # file > default
    assert s.engine.max_batch == 16  # default
    # flags not given leave the environment's and the file's values alone
    s = settings_from(["--config", str(cfg)], env)
    assert (s.server.port, s.trainer.train, s.scoring.reward_functions) == \
        (7002, True, ["a:env", "b:env"])
    s = settings_from(["--config", str(cfg)])
    assert (s.server.port, s.trainer.train, s.cache.kv_bits) == (7000, False, 4)
    assert settings_from(["--config", str(cfg), "--train"]).trainer.train is True


def test_demo_guard_flag_parses():
    assert build_parser().parse_args(["demo", "--guard"]).guard is True
    args = build_parser().parse_args(["demo"])
    assert (args.guard, args.model, args.steps) == (False, "smollm2-135m-instruct", None)


def test_serve_process_merges_file_environment_and_flags(tmp_path):
    """`rlproxy serve` as a user starts it: each source visibly wins where it should."""
    cfg = tmp_path / "rlproxy.toml"
    cfg.write_text('[server]\nserved_model_name = ["from-toml"]\napi_key = "toml-key"\n'
                   '[cache]\nprefix_cache = true\n[scoring]\nmethod = "combine"\n')
    server = Served(tmp_path / "data", "--config", str(cfg), "--no-prefix-cache", "--method", "rl",
                    "--no-train", "--log-level", "WARNING",
                    env={"RLPROXY_API_KEY": "env-key", "RLPROXY_METHOD": "opd"}, wait_s=60,
                    ok_only=False)
    url, key = server.url, {"Authorization": "Bearer env-key"}
    try:
        health = requests.get(url + "/healthz", headers=key, timeout=2)
        assert health.status_code == 200, health.text
        h = health.json()
        assert h["served_model_names"] == ["from-toml"]  # the file, nothing overrides it
        assert h["prefix_cache"]["enabled"] is False  # --no-prefix-cache beats the file
        assert h["scoring"]["method"] == "rl"  # the flag beats the environment and the file
        # the environment's key beats the file's
        toml_key = {"Authorization": "Bearer toml-key"}
        assert requests.get(url + "/v1/models", headers=toml_key, timeout=5).status_code == 401
        assert requests.get(url + "/v1/models", headers=key, timeout=5).status_code == 200
    finally:
        server.proc.kill()
        server.proc.wait(timeout=30)
