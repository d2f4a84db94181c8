"""The `rlproxy` command: parses flags into Settings and runs the chosen subcommand."""

from __future__ import annotations

import argparse
import logging
import sys

from rlproxy.settings import load_settings


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [server], [model], [engine], [records] sections")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (env RLPROXY_API_KEY)")
    p.add_argument("--max-request-mb", type=float, help="largest request body accepted (32)")
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
    p.add_argument("--max-batch", type=int, help="sequences decoded together (16)")
    p.add_argument("--default-max-tokens", type=int,
                   help="completion cap when a request sets no max_tokens (1024)")
    p.add_argument("--data-dir", help="where records and checkpoints go (~/.rlproxy)")
    p.add_argument("--session-idle-timeout-s", type=float,
                   help="close a session after this many idle seconds (1800)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false", default=None,
                   help="do not fsync record lines (faster; a power cut may lose the last ones)")
    p.add_argument("--log-level", default="INFO")


def flags_from(args: argparse.Namespace) -> dict:
    skip = {"command", "config", "log_level", "func"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from rlproxy.server import create_app

    settings = load_settings(flags_from(args), args.config)
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
    records = sub.add_parser("records", help="read the JSONL training records")
    rsub = records.add_subparsers(dest="records_command", required=True)
    t = rsub.add_parser("tail", help="print recorded turns readably")
    t.add_argument("--data-dir", help="the server's --data-dir (~/.rlproxy)")
    t.add_argument("--follow", "-f", action="store_true", help="keep printing new turns")
    t.add_argument("--session", help="only this session id")
    t.set_defaults(func=records_tail)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # settings problems: say what to change, no traceback
        print(f"rlproxy: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
