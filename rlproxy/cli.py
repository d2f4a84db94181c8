"""The `rlproxy` command: parses flags into Settings and runs the chosen subcommand."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlproxy import progress
from rlproxy.logs import setup_logging
from rlproxy.settings import load_settings


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with sections [server] [model] [engine] [cache] "
                   "[scoring] [trainer] [records] [sessions]")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (env RLPROXY_API_KEY)")
    p.add_argument("--max-request-mb", type=float, help="largest request body accepted (32)")
    p.add_argument("--tinker-max-models", type=int,
                   help="Tinker training clients alive at once (4; 0 turns /api/v1 off)")
    p.add_argument("--served-model-name", action="append",
                   help="a name /v1/models lists (repeat for aliases)")
    p.add_argument("--strict-model-names", action="store_true", default=None,
                   help="answer unknown model names with 404 model_not_found")
    p.add_argument("--model", help="mlx-lm model path or hub id (default: the embedded model)")
    p.add_argument("--embedded-size", help="size of the embedded model: tiny (default), small")
    p.add_argument("--adapter", help="mlx-lm adapter directory to start from")
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--lora-scale", type=float)
    p.add_argument("--lora-layers", type=int, help="LoRA on the last N blocks (-1: all)")
    p.add_argument("--quantize-bits", type=int,
                   help="QLoRA: quantize the frozen base to 4 or 8 bits (slower on CPU)")
    p.add_argument("--lora-keys", action="append",
                   help="projection to adapt, e.g. self_attn.q_proj (repeat; default: all)")
    p.add_argument("--max-batch", type=int, help="sequences decoded together (16)")
    p.add_argument("--default-max-tokens", type=int,
                   help="completion cap when a request sets no max_tokens (1024)")
    p.add_argument("--strict-max-tokens", action="store_true", default=None,
                   help="answer a max_tokens beyond the context with 400 (default: clamp it)")
    p.add_argument("--reasoning-parser", choices=["auto", "none"],
                   help="auto (default): <think> text is returned as reasoning, not content")
    p.add_argument("--data-dir", help="where records and checkpoints go (~/.rlproxy)")
    p.add_argument("--method", choices=["rl", "opd", "combine"],
                   help="scoring: rl (PRM judge reward), opd (hint + teacher log-probs), combine")
    p.add_argument("--prm-m", type=int, help="judge votes per turn (3)")
    p.add_argument("--prm-temperature", type=float, help="judge sampling temperature (0.6)")
    p.add_argument("--prm-max-tokens", type=int, help="judge answer length cap (256)")
    p.add_argument("--prm-max-context-chars", type=int,
                   help="trim the user request shown to the judge (4000)")
    p.add_argument("--prm-prompts", help="folder with judge.txt and hint.txt (prm_prompts/)")
    p.add_argument("--w-opd", type=float, help="weight of teacher_lp - behaviour_lp (1.0)")
    p.add_argument("--w-rl", type=float, help="weight of the reward (1.0)")
    p.add_argument("--at-least-one", dest="at_least_one", action="store_true", default=None,
                   help="if every scored turn of a closed session is <= 0, its best gets +1 (on)")
    p.add_argument("--no-at-least-one", dest="at_least_one", action="store_false")
    p.add_argument("--feedback-mode", choices=["override", "add"],
                   help="explicit feedback replaces (override) or adds to the judge reward")
    p.add_argument("--reward-function", dest="reward_functions", action="append",
                   help="module:function returning a reward in [-1, 1] or None (repeatable)")
    p.add_argument("--no-judge", dest="judge", action="store_false", default=None,
                   help="no PRM votes: rewards only from feedback and --reward-function")
    p.add_argument("--judge-url", help="OpenAI-compatible judge base URL (default: local model)")
    p.add_argument("--judge-model", help="model name sent to --judge-url")
    p.add_argument("--judge-api-key", help="API key for --judge-url")
    p.add_argument("--teacher-url", help="vLLM-compatible URL giving prompt log-probs (OPD)")
    p.add_argument("--no-train", dest="train", action="store_false", default=None,
                   help="serve, record and score, but never update the adapter")
    p.add_argument("--loss-fn", choices=["ppo", "importance_sampling", "cispo", "dro",
                                         "cross_entropy"], help="policy loss (ppo)")
    p.add_argument("--eps-low", type=float, help="PPO/CISPO lower clip (0.2)")
    p.add_argument("--eps-high", type=float, help="PPO/CISPO upper clip (0.28)")
    p.add_argument("--dro-beta", type=float, help="DRO quadratic penalty (0.1)")
    p.add_argument("--kl-coef", type=float, help="KL penalty to the base model (0: off)")
    p.add_argument("--learning-rate", type=float, help="AdamW learning rate (1e-5)")
    p.add_argument("--batch-size", type=int, help="scored turns per optimizer step (4)")
    p.add_argument("--train-epochs", type=int, help="optimizer steps per batch (1)")
    p.add_argument("--max-context-tokens", type=int, help="skip longer turns (40960)")
    p.add_argument("--prompt-grad", choices=["full", "none"],
                   help="gradient through the prompt's keys/values: none (default, ~1 prefill "
                   "per step) or full (exact, ~3x slower)")
    p.add_argument("--train-chunk-tokens", type=int,
                   help="positions per training unit; smaller yields to serving sooner (128)")
    p.add_argument("--train-memory-gb", type=float,
                   help="skip turns estimated to need more to train (half of physical memory)")
    p.add_argument("--grad-clip", type=float, help="max gradient norm (1.0; 0: off)")
    p.add_argument("--baseline", choices=["none", "mean"], help="reward baseline (mean)")
    p.add_argument("--save-interval", type=int, help="checkpoint every N steps (10)")
    p.add_argument("--keep-checkpoints", type=int, help="keep the last N checkpoints (3)")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=None,
                   help="start fresh instead of from the newest checkpoint")
    p.add_argument("--duty-cycle", type=float,
                   help="share of time training may use while requests decode (0.5)")
    p.add_argument("--max-step-attempts", type=int,
                   help="failed steps (an error, or the process dying) a turn gets before it is "
                   "quarantined and never trained (2: one retry)")
    p.add_argument("--judge-timeout-s", type=float)
    p.add_argument("--judge-retries", type=int)
    p.add_argument("--judge-concurrency", type=int)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="do not keep prompt KV state in memory or on disk")
    p.add_argument("--prefix-cache-disk-limit-gb", type=float, help="disk budget (4)")
    p.add_argument("--prefix-cache-memory-mb", type=float, help="in-memory LRU budget (512)")
    p.add_argument("--kv-bits", type=int, help="quantize KV state to 4 or 8 bits")
    p.add_argument("--kv-group-size", type=int, help="KV quantization group size (64)")
    p.add_argument("--quantized-kv-start", type=int,
                   help="quantize KV only past this many tokens (0)")
    p.add_argument("--kv-reuse-max-lag", type=int,
                   help="reuse prefix KV from up to N adapter versions ago (4; 0: never)")
    p.add_argument("--session-idle-timeout-s", type=float,
                   help="close a session after this many idle seconds (1800)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false", default=None,
                   help="do not fsync record lines (faster; a power cut may lose the last ones)")
    p.add_argument("--responses-store-mb", type=float,
                   help="disk kept for stored Responses (previous_response_id) (256)")
    p.add_argument("--metrics-public", action="store_true", default=None,
                   help="serve /metrics without the API key (the dashboard stays behind it)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="text (default) or json lines with session id, turn uid, adapter version")


def flags_from(args: argparse.Namespace) -> dict:
    """The flags that are settings (a subcommand's own arguments, like --from, are not)."""
    from rlproxy.settings import SECTIONS

    fields = {name for cls in SECTIONS.values() for name in cls.model_fields}
    return {k: v for k, v in vars(args).items() if k in fields}


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from rlproxy.server import create_app

    settings = load_settings(flags_from(args), args.config)
    setup_logging(args.log_level, settings.server.log_format)  # flag > env > the TOML file
    app = create_app(settings)
    web.run_app(app, host=settings.server.host, port=settings.server.port,
                print=lambda msg: print(msg, flush=True),
                access_log=None)
    return 0


def short(text, limit: int = 80) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_turn(r: dict) -> str:
    import time as _time

    choice = r["choices"][r.get("chosen_choice", 0)]
    when = _time.strftime("%H:%M:%S", _time.localtime(r["timings"]["received"]))
    asked = next((m["content"] for m in reversed(r["messages"]) if m["role"] == "user"), "")
    calls = " ".join(f"{c['function']['name']}({short(c['function']['arguments'], 40)})"
                     for c in choice["tool_calls"])
    said = short(choice["text"], 60) + (f" [calls {calls}]" if calls else "")
    if r["next_state"] is None:
        after = f"(no next state: {r['end']})"
    else:
        after = " ".join(f"{m['role']}: {short(m.get('content'), 40)}" for m in r["next_state"])
    step = f" step {r['step_index']}" if r.get("step_index") is not None else ""
    return (f"{when} {r['session_id']} #{r['index']}{step} {r['turn_type']} "
            f"{len(r['prompt_ids'])}+{len(choice['completion_ids'])} tok\n"
            f"    user: {short(asked)}\n    assistant: {said}\n    next: {after}")


def records_tail(args: argparse.Namespace) -> int:
    from rlproxy.records import CONVERSATIONS, follow_jsonl, read_jsonl

    settings = load_settings({"data_dir": args.data_dir})
    path = settings.records.data_dir / CONVERSATIONS
    lines = follow_jsonl(path) if args.follow else read_jsonl(path)
    try:
        for record in lines:
            if args.session and record.get("session_id") != args.session:
                continue
            print(format_turn(record), flush=True)
    except KeyboardInterrupt:
        pass
    return 0


def fuse_cmd(args: argparse.Namespace) -> int:
    from rlproxy.checkpoints import fuse
    from rlproxy.model import resolve_model_path

    settings = load_settings({"model": args.model, "embedded_size": args.embedded_size})
    source, _ = resolve_model_path(settings.model)
    # one unit: fuse() loads, merges and saves in one call; the bar shows the time it takes
    with progress.phase("fused the adapter into the model"), progress.bar(
            total=1, desc="fusing", unit="model") as done:
        out = fuse(source, Path(args.adapter), Path(args.out))
        done.update()
    print(f"fused model written to {out} (open it with mlx_lm.load or rlproxy serve --model)")
    return 0


def train_cmd(args: argparse.Namespace) -> int:
    """Retrain from recorded turns and scores with the live trainer's code path."""
    from rlproxy.model import load_serving_model
    from rlproxy.trainer import Trainer, released_turns, training_copy

    source = Path(args.source)
    flags = flags_from(args)
    # Never write into the live server's data dir by accident: default beside the source.
    flags["data_dir"] = flags.get("data_dir") or str(source / "offline-train")
    settings = load_settings(flags, args.config)
    setup_logging(args.log_level, settings.server.log_format)
    with progress.phase("read the released turns"):
        turns = released_turns(source, settings.scoring.w_opd, settings.scoring.w_rl,
                               max_attempts=settings.trainer.max_step_attempts)
    if not turns:
        print(f"rlproxy: no scored turns released for training in {source}", file=sys.stderr)
        return 1
    with progress.phase("loaded the model"):
        loaded = load_serving_model(settings.model)
    out = settings.records.data_dir
    trainer = Trainer(settings, training_copy(loaded), loaded.lora_config, data_dir=out,
                      vocab_size=loaded.vocab_size)
    trainer.trained = set()  # retrain everything, whatever an earlier run did
    size = settings.trainer.batch_size
    for start in progress.bar(range(0, len(turns) - size + 1, size), desc="training",
                              unit="batch"):
        for line in trainer.train_journaled(turns[start:start + size]):
            progress.write(f"step {line['step']}: loss {line['loss']:.4f} "
                           f"reward_mean {line['reward_mean']} tokens {line['tokens']}")
    path = trainer.save()
    trainer.writer.close()
    print(f"{len(turns)} turns, {trainer.step} steps; adapter checkpoint: {path}")
    return 0


def status_cmd(args: argparse.Namespace) -> int:
    from rlproxy.status import status_cmd as run

    return run(args)


def demo_cmd(args: argparse.Namespace) -> int:
    from rlproxy.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlproxy",
        description="OpenAI-compatible proxy that serves an MLX model and learns from agent "
        "traffic. Point an agent at base_url=http://127.0.0.1:8000/v1.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_flags(p)
    p.set_defaults(func=serve)
    f = sub.add_parser("fuse", help="merge an adapter into the base model's weights")
    f.add_argument("--adapter", required=True, help="adapter dir (e.g. a checkpoint step_*)")
    f.add_argument("--out", required=True, help="where to write the fused model")
    f.add_argument("--model", help="base model path or hub id (default: the embedded model)")
    f.add_argument("--embedded-size", help="embedded model size when --model is not given")
    f.set_defaults(func=fuse_cmd)
    tr = sub.add_parser("train", help="retrain an adapter offline from recorded, scored turns")
    tr.add_argument("--from", dest="source", required=True, help="a server's --data-dir")
    add_serve_flags(tr)  # model, LoRA and trainer flags; --data-dir is where results go
    tr.set_defaults(func=train_cmd)
    d = sub.add_parser("demo", help="watch the proxy learn: a scripted agent, a verifiable "
                       "reward, PPO steps, a plot (embedded model, no network)")
    d.add_argument("--steps", type=int, default=30, help="PPO steps to run (30)")
    d.add_argument("--out", default="rlproxy-demo", help="folder for the plot and records")
    d.add_argument("--embedded-size", default="tiny")
    d.add_argument("--log-level", default="WARNING")
    d.set_defaults(func=demo_cmd)
    records = sub.add_parser("records", help="read the JSONL training records")
    rsub = records.add_subparsers(dest="records_command", required=True)
    t = rsub.add_parser("tail", help="print recorded turns readably")
    t.add_argument("--data-dir", help="the server's --data-dir (~/.rlproxy)")
    t.add_argument("--follow", "-f", action="store_true", help="keep printing new turns")
    t.add_argument("--session", help="only this session id")
    t.set_defaults(func=records_tail)
    st = sub.add_parser("status", help="one screen about a running server: model, adapter, "
                        "sessions, recent steps, cache, trainer")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the server (:8000 locally)")
    st.add_argument("--api-key", help="its --api-key, for the step history (env RLPROXY_API_KEY)")
    st.set_defaults(func=status_cmd)
    args = parser.parse_args(argv)
    if args.func not in (serve, train_cmd):  # those two set it up from their loaded settings
        setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", None)
                      or os.environ.get("RLPROXY_LOG_FORMAT") or "text")
    try:
        return args.func(args)
    except ValueError as e:  # settings problems: say what to change, no traceback
        print(f"rlproxy: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
