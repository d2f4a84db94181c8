"""The `rlproxy` command: parses flags into Settings and runs the chosen subcommand."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import logging
import os
import re
import sys
from pathlib import Path

from rlproxy import preflight
from rlproxy.flags import SETTINGS_SOURCES, add_serve_flags, add_setting_flag, flags_from
from rlproxy.ops import progress
from rlproxy.ops.logs import setup_logging
from rlproxy.ops.ranks import launched_rank
from rlproxy.paths import (CHECKPOINTS, CONVERSATIONS, DataDirInUse, complete_checkpoints,
                           lock_data_dir)
from rlproxy.settings import ModelSettings, load_settings

log = logging.getLogger("rlproxy.server")

# The exit statuses (the README's "Exit codes" lists them): 0 done, 1 the command ran and
# failed, 2 a mistake in the command line or settings, 3 what it needs is in use.
FAILED, USAGE, IN_USE = 1, 2, 3


def serve(args: argparse.Namespace) -> int:
    settings = load_settings(flags_from(args), args.config)
    setup_logging(args.log_level, settings.server.log_format)  # flag > env > the TOML file
    preflight.check_model(settings.model.model)  # one line in a second, before any loading
    preflight.check_adapter(settings.model.adapter)
    if launched_rank() is not None:  # under mlx.launch: ranks but 0 only compute gradients
        if (code := gradient_worker(settings)) is not None:
            return code
    preflight.check_port(settings.server.host, settings.server.port)
    # first: a second server on one data dir stops here, before it loads or writes anything
    with data_dir_locked(settings.records.data_dir, server_url(settings)):
        served_adapter(settings)
        from rlproxy.api import server  # (before mlx_lm: it notes the open-file limit)
        from rlproxy.app import create_app

        app = create_app(settings)
        host, port = settings.server.host, settings.server.port
        try:  # server.run_app: aiohttp's own parse errors (bad headers ...) answered as JSON
            server.run_app(app, host=host, port=port, print=lambda msg: print(msg, flush=True))
        except OSError as e:  # taken since the check above: the same one line
            if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                raise preflight.bind_error(e, host, port) from None
            raise
    return 0


def gradient_worker(settings) -> int | None:
    """Under a launch: check the settings on every rank; a rank other than 0 then works for
    rank 0 (training/distributed.py) and returns its exit code; rank 0 gets None and goes on."""
    from rlproxy.training import distributed

    distributed.check(settings)
    if launched_rank() == 0 or (group := distributed.group()) is None:
        return None
    return distributed.work(settings, distributed.Link(group, None))


def served_adapter(settings) -> None:
    """With --no-train and no --adapter: serve the data dir's newest checkpoint (what was
    trained there), saying so; `--adapter base` serves the base model. The trainer resumes from
    that checkpoint itself when it runs."""
    model = settings.model
    if model.adapter == "base":
        model.adapter = None
        log.info("--adapter base: serving the base model without an adapter")
    elif settings.trainer.train or settings.remote.sampler == "tinker":
        return
    elif model.adapter is None and (kept := complete_checkpoints(
            settings.records.data_dir / CHECKPOINTS)):
        model.adapter = str(kept[-1])
        log.info("--no-train: serving the adapter trained in this data dir, checkpoint %s "
                 "(--adapter base serves the base model)", kept[-1])


def server_url(settings) -> str:
    host = settings.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.server.port}"


@contextlib.contextmanager
def data_dir_locked(data_dir: Path, url: str | None = None):
    """Hold the data dir's lock (paths.lock_data_dir: one writer per folder) for the block;
    a server notes its URL there (`rlproxy export` finds it)."""
    fd = lock_data_dir(data_dir, url)
    try:
        yield
    finally:
        os.close(fd)


def records_tail(args: argparse.Namespace) -> int:
    from rlproxy.ops.tail import tail

    settings = load_settings({"data_dir": args.data_dir, "model": args.model})
    try:
        tail(settings.records.data_dir, args.session, args.follow)
    except KeyboardInterrupt:
        pass
    return 0


def records_compact(args: argparse.Namespace) -> int:
    from rlproxy.compaction import compact

    settings = load_settings({"data_dir": args.data_dir, "model": args.model})
    data_dir = settings.records.data_dir
    if args.keep_sessions is not None:
        try:
            re.compile(args.keep_sessions)
        except re.error as e:  # exit 2, in one line (main)
            raise ValueError(f"--keep-sessions {args.keep_sessions!r} is not a regular "
                             f"expression: {e}") from None
    if not (data_dir / CONVERSATIONS).exists():
        print(f"rlproxy: no records to compact in {data_dir}", file=sys.stderr)
        return 1
    with data_dir_locked(data_dir):  # never under a server that writes them
        with progress.phase("compacted the records"):
            done = compact(data_dir, settings, args.keep_sessions)
    if not done["turns"]:
        print(f"nothing to compact in {data_dir}: every session is still open, not trained yet "
              "or kept")
        return 0
    mb = {k: round(v / 2**20, 1) for k, v in done["before"].items()}
    after = {k: round(v / 2**20, 1) for k, v in done["after"].items()}
    print(f"moved {done['turns']} turns of {done['sessions']} closed, trained sessions to "
          f"{done['segment']}; live files (MB) before {mb}, after {after}")
    return 0


def fuse_cmd(args: argparse.Namespace) -> int:
    from rlproxy.serving.model import resolve_model_path
    from rlproxy.training.checkpoints import fuse

    settings = load_settings({"model": args.model})
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
    source = Path(args.source)
    flags = flags_from(args)
    # Never write into the live server's data dir by accident: default beside the source.
    flags["data_dir"] = flags.get("data_dir") or str(source / "offline-train")
    settings = load_settings(flags, args.config)
    setup_logging(args.log_level, settings.server.log_format)
    if launched_rank() is not None:  # under mlx.launch: ranks but 0 only compute gradients
        if (code := gradient_worker(settings)) is not None:
            return code
    with data_dir_locked(settings.records.data_dir):  # nor into one another process writes
        return retrain(source, settings)


def retrain(source: Path, settings) -> int:
    from rlproxy.training import distributed
    from rlproxy.training.items import released_turns

    with progress.phase("read the released turns"):
        turns = released_turns(source, settings.scoring.w_opd, settings.scoring.w_rl,
                               max_attempts=settings.trainer.max_step_attempts)
    if not turns:
        print(f"rlproxy: no scored turns released for training in {source}", file=sys.stderr)
        return 1
    ranks = distributed.join(settings)  # under mlx.launch: the other ranks (else None)
    try:
        return retrain_on(turns, settings, ranks)
    finally:
        if ranks is not None:
            distributed.leave(ranks)  # the other ranks exit


def retrain_on(turns: list[dict], settings, ranks) -> int:
    from rlproxy.lru import LRU
    from rlproxy.serving.model import load_serving_model
    from rlproxy.training.learner import LearnerUnavailable, training_copy
    from rlproxy.training.loop import Trainer

    with progress.phase("loaded the model"):
        loaded = load_serving_model(settings.model, lora_seed=settings.trainer.train_seed)
    out = settings.records.data_dir
    trainer = Trainer(settings, training_copy(loaded), loaded.lora_config, data_dir=out,
                      vocab_size=loaded.vocab_size, ranks=ranks)
    trainer.trained = LRU()  # retrain everything, whatever an earlier run did
    size = settings.trainer.batch_size
    try:
        for start in progress.bar(range(0, len(turns) - size + 1, size), desc="training",
                                  unit="batch"):
            for line in trainer.train_journaled(turns[start:start + size]):
                progress.write(f"step {line['step']}: loss {line['loss']:.4f} "
                               f"reward_mean {line['reward_mean']} tokens {line['tokens']}")
        path = trainer.save()
    except LearnerUnavailable as e:  # under mlx.launch: a rank died or hangs
        print(f"rlproxy: training stopped after {trainer.step} steps: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.writer.close()
    print(f"{len(turns)} turns, {trainer.step} steps; adapter checkpoint: {path}")
    return 0


def status_cmd(args: argparse.Namespace) -> int:
    from rlproxy.ops.status import status_cmd as run

    return run(args)


def connect_cmd(args: argparse.Namespace) -> int:
    from rlproxy.connect.command import connect_cmd as run

    return run(args)


def export_cmd(args: argparse.Namespace) -> int:
    from rlproxy.training.export import export_cmd as run

    return run(args)


def demo_cmd(args: argparse.Namespace) -> int:
    from rlproxy.demo.run import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlproxy", allow_abbrev=False,
        description="OpenAI-compatible proxy that serves an MLX model and learns from agent "
        "traffic. Point an agent at base_url=http://127.0.0.1:8000/v1.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # allow_abbrev off: a new setting must not make an abbreviation someone uses ambiguous
    p = sub.add_parser("serve", help="run the OpenAI-compatible server", allow_abbrev=False,
                       usage="%(prog)s [--config FILE] [--SETTING VALUE ...]",
                       description=SETTINGS_SOURCES)
    add_serve_flags(p)
    p.set_defaults(func=serve)
    f = sub.add_parser("fuse", help="merge an adapter into the base model's weights")
    f.add_argument("--adapter", required=True, help="adapter dir (e.g. a checkpoint step_*)")
    f.add_argument("--out", required=True, help="where to write the fused model")
    add_setting_flag(f, "model")
    f.set_defaults(func=fuse_cmd)
    tr = sub.add_parser("train", help="retrain an adapter offline from recorded, scored turns",
                        allow_abbrev=False, description=SETTINGS_SOURCES,
                        usage="%(prog)s --from DATA_DIR [--config FILE] [--SETTING VALUE ...]")
    tr.add_argument("--from", dest="source", required=True, help="a server's --data-dir")
    add_serve_flags(tr)  # model, LoRA and trainer flags; --data-dir is where results go
    tr.set_defaults(func=train_cmd)
    c = sub.add_parser("connect", help="point an agent at this server: write its own config "
                       "(merged, backed up; --undo restores it)")
    c.add_argument("agent", choices=("codex", "claude", "opencode", "openclaw", "hermes"))
    c.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server (default: http://127.0.0.1:8000)")
    c.add_argument("--model", help="model name the agent asks for (default: the served one)")
    c.add_argument("--adapter", help="a personal adapter for this agent's traffic: the agent "
                   "asks for MODEL:ADAPTER, which learns only from its own sessions")
    c.add_argument("--api-key", help="the server's --api-key (default: a placeholder)")
    c.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    c.add_argument("--undo", action="store_true", help="restore the agent's config from the "
                   "backup, byte for byte")
    c.add_argument("--check", action="store_true", help="run one short turn through the agent "
                   "and say where it landed")
    c.set_defaults(func=connect_cmd)
    e = sub.add_parser("export", help="write an adapter for other tools: PEFT (vLLM, peft), "
                       "mlx-lm, a fused model or GGUF")
    src = e.add_mutually_exclusive_group()
    add_setting_flag(src, "data_dir", help="a server's --data-dir: the adapter it serves "
                     "now while it runs, else its newest (or --step) checkpoint (default: "
                     "~/.rlproxy/<model>/)")
    src.add_argument("--adapter", help="an adapter directory (mlx-lm or PEFT layout)")
    e.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    e.add_argument("--url", help="a running server to take the adapter it serves now from "
                   "(default: the one running on --data-dir, if any)")
    e.add_argument("--api-key", help="that server's --api-key (env RLPROXY_API_KEY)")
    e.add_argument("--format", required=True, choices=("peft", "mlx", "fused", "gguf"))
    e.add_argument("--out", required=True, help="the folder to write")
    add_setting_flag(e, "model")
    add_setting_flag(e, "context_length")
    e.set_defaults(func=export_cmd)
    d = sub.add_parser("demo", help="watch the proxy learn: a scripted agent, a verifiable "
                       "reward, PPO steps, a plot (SmolLM2 by default; --model tiny: no network)")
    d.add_argument("--steps", type=int, default=None,
                   help="PPO steps to run (default: 12 on a real model, 30 on tiny or small)")
    d.add_argument("--out", default="rlproxy-demo",
                   help="folder for the plot and records (default: rlproxy-demo)")
    add_setting_flag(d, "model", default=ModelSettings().model)
    d.add_argument("--guard", action="store_true",
                   help="turn the eval gate on and raise the learning rate until it rolls back")
    d.add_argument("--log-level", default="WARNING", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING or ERROR (default: WARNING)")
    d.set_defaults(func=demo_cmd)
    records = sub.add_parser("records", help="read the JSONL training records, or compact them")
    rsub = records.add_subparsers(dest="records_command", required=True)
    t = rsub.add_parser("tail", help="print recorded turns readably, with each turn's reward "
                        "and why, and the turns still waiting for their next state")
    add_setting_flag(t, "data_dir", help="the server's --data-dir (default: "
                     "~/.rlproxy/<model>/, the --model's)")
    add_setting_flag(t, "model")
    t.add_argument("--follow", "-f", action="store_true", help="keep printing new turns")
    t.add_argument("--session", help="only this session id")
    t.set_defaults(func=records_tail)
    c = rsub.add_parser("compact", help="move closed, trained sessions out of the files "
                        "start-up reads into segments/ (which `rlproxy train --from` reads); "
                        "the server must be stopped")
    add_setting_flag(c, "data_dir", help="the server's --data-dir (default: "
                     "~/.rlproxy/<model>/, the --model's)")
    add_setting_flag(c, "model")
    c.add_argument("--keep-sessions", metavar="REGEX",
                   help="sessions whose id matches stay in the live files")
    c.set_defaults(func=records_compact)
    st = sub.add_parser("status", help="one screen about a running server: model, adapter, "
                        "sessions, recent steps, cache, trainer")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the server (:8000 locally)")
    st.add_argument("--api-key", help="its --api-key, for the step history (env RLPROXY_API_KEY)")
    st.set_defaults(func=status_cmd)
    parser.set_defaults(subparsers={**sub.choices, "records": rsub.choices})
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; an unknown one is an error of the subcommand it was given to, shown with
    that subcommand's usage and the closest flag it has (argparse would show the top level's)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = args.subparsers[args.command]
        if isinstance(sub, dict):  # `records tail`
            sub = sub[args.records_command]
        flags = [f for action in sub._actions for f in action.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close and unknown[0].startswith("-") else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}; `{sub.prog} --help` "
                  "lists every flag")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.func not in (serve, train_cmd):  # those two set it up from their loaded settings
        setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", None)
                      or os.environ.get("RLPROXY_LOG_FORMAT") or "text")
    try:
        return args.func(args)
    except (DataDirInUse, preflight.PortInUse) as e:  # another process has it: say which
        print(f"rlproxy: {e}", file=sys.stderr)
        return IN_USE
    except ValueError as e:  # settings problems, an unknown model, an adapter that does not fit
        print(f"rlproxy: {e}", file=sys.stderr)
        return USAGE


if __name__ == "__main__":
    sys.exit(main())
