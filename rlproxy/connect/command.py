"""The `rlproxy connect AGENT` flow: ask the server what it serves, read the agent's config file,
merge rlproxy's settings in, show the diff, keep the first backup, write atomically; `--undo`
puts the backup back byte for byte; `--check` then runs one turn through the agent (check.py).

What goes into each agent's file is agents.py's; how each format is read and written,
formats.py's."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
import tempfile
import urllib.error
from pathlib import Path

from rlproxy.connect import check
from rlproxy.connect.agents import AGENTS, BUDGET_CAVEATS, WINDOW_NEEDS, Target
from rlproxy.connect.formats import ConfigError, dump, load
from rlproxy.ops.status import fetch
from rlproxy.settings import ModelSettings, adapter_name

PLACEHOLDER_KEY = "rlproxy"  # the server checks no key unless it was started with --api-key


def backup_of(path: Path) -> Path:
    return path.with_name(path.name + ".rlproxy-backup")


def created_mark(path: Path) -> Path:
    """Present when connect created the file: undo removes it rather than restoring it."""
    return path.with_name(path.name + ".rlproxy-created")


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write to a temp file beside `path`, then rename over it: never a half-written config."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class KeyRefused(Exception):
    """The server answered 401/403: it wants an API key connect was not given (or another)."""


def served(url: str, key: str, model: str | None) -> tuple[str | None, int | None, int | None]:
    """(the served model name, its context window, its --max-completion-tokens) from GET
    /v1/models; Nones when the server does not answer. A `model` given by the user picks its
    card if the server lists it."""
    try:
        cards = fetch(f"{url}/v1/models", key)["data"]
    except urllib.error.HTTPError as e:  # a URLError too: it answered, and said no
        if e.code in (401, 403):
            raise KeyRefused(f"the server at {url} answered {e.code} to GET /v1/models: it was "
                             "started with --api-key; pass the same key with --api-key") from None
        return None, None, None
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None, None, None
    card = next((c for c in cards if c["id"] == model), cards[0] if cards else None)
    if card is None:
        return None, None, None
    return (card["id"], card.get("context_length") or card.get("max_input_tokens"),
            card.get("max_completion_tokens"))


def base_url(url: str) -> str:
    """The server's root: agents that speak OpenAI get <root>/v1, Claude Code the root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def unified(old: str, new: str, path: Path, existed: bool) -> str:
    return "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=str(path) if existed else "/dev/null", tofile=str(path)))


def undo(path: Path) -> int:
    backup, mark = backup_of(path), created_mark(path)
    if backup.exists():
        os.replace(backup, path)  # the user's own bytes and mode, in one rename
        mark.unlink(missing_ok=True)
        print(f"restored {path} from {backup}")
        return 0
    if mark.exists():
        path.unlink(missing_ok=True)
        mark.unlink()
        print(f"removed {path} (rlproxy connect had created it)")
        return 0
    print(f"rlproxy connect: nothing to undo: no backup {backup} and {path} was not created "
          "by rlproxy connect", file=sys.stderr)
    return 1


def connect(agent_name: str, target: Target, dry_run: bool) -> int:
    agent = AGENTS[agent_name]
    path = Path(os.path.realpath(agent.path()))  # through a symlink: replace its target
    existed = path.exists()
    raw = path.read_bytes() if existed else b""
    try:
        old = raw.decode("utf-8")
        doc = load(agent.fmt, old, str(path))
        agent.merge(doc, target)
        new = dump(agent.fmt, doc, old)
    except (ConfigError, UnicodeDecodeError) as e:
        print(f"rlproxy connect: {e}; nothing written", file=sys.stderr)
        return 1
    if dry_run:
        print(unified(old, new, path, existed) or f"{path}: already connected, no change")
        print("(dry run: nothing written)")
        return 0
    if new == old:
        print(f"{path}: already connected, no change")
        return 0
    backup, mark = backup_of(path), created_mark(path)
    mode = path.stat().st_mode & 0o777 if existed else 0o600  # it holds the API key
    if not backup.exists() and not mark.exists():  # the first backup is the user's: keep it
        if existed:
            write_atomic(backup, raw, mode)
        else:
            write_atomic(mark, b"", 0o600)
    print(unified(old, new, path, existed), end="")
    write_atomic(path, new.encode("utf-8"), mode)
    kept = backup if backup.exists() else None
    print(f"wrote {path}" + (f" (your original: {kept})" if kept else " (a new file)")
          + f"; `rlproxy connect {agent_name} --undo` puts it back")
    return 0


def suggested_window(need: int) -> int:
    """The --context-length to suggest: the power of two at or above `need` (room for a reply)."""
    return 1 << (need - 1).bit_length()


def report_window(agent_name: str, context: int | None) -> None:
    """Say whether the served window holds what the agent sends, and if not, what fixes it."""
    need, why = WINDOW_NEEDS[agent_name]
    name = AGENTS[agent_name].name
    if context is None:
        print(f"{name} needs a window of {need:,} tokens ({why}); the server did not say its "
              "window")
    elif context < need:
        wanted = suggested_window(need)
        print(f"warning: the server's window is {context:,} tokens and {name} needs {need:,} "
              f"({why}). Restart the server with `rlproxy serve --context-length {wanted}` (a "
              "RoPE model is stretched past its trained window, at lower quality; one that "
              f"cannot be is refused at start: then serve a model trained on {wanted:,} tokens "
              "or more), or with `rlproxy serve --model tiny` (random weights, a window every "
              "agent fits in) to check the plumbing only")
    else:
        print(f"the server's window is {context:,} tokens; {name} needs {need:,} ({why})")


def report_budget(agent_name: str, target: Target) -> None:
    """Say the completion budget written, and where the agent does not keep to it (a note: the
    "warning:" lines are the window's, which stop an agent from working at all)."""
    name, caveat = AGENTS[agent_name].name, BUDGET_CAVEATS.get(agent_name)
    if target.budget and agent_name != "codex":
        print(f"{name}'s completion budget: {target.budget:,} tokens (an eighth of the window, "
              "at most 8,192" + (", within the server's --max-completion-tokens" if target.cap
                                 else "") + ")")
    if caveat and not (target.cap and agent_name == "hermes"):  # the cap holds its retries
        print(f"note: {caveat}")


def connect_cmd(args: argparse.Namespace) -> int:
    agent = AGENTS[args.agent]
    if args.undo:
        if args.check or args.dry_run:
            print("rlproxy connect: --undo takes no --check or --dry-run", file=sys.stderr)
            return 2
        return undo(Path(os.path.realpath(agent.path())))
    url, key = base_url(args.url), args.api_key or PLACEHOLDER_KEY
    adapter = None
    if getattr(args, "adapter", None):
        try:
            adapter = adapter_name(args.adapter)
        except ValueError as e:
            print(f"rlproxy connect: --adapter: {e}", file=sys.stderr)
            return 2
    try:
        name, context, cap = served(url, key, args.model)
    except KeyRefused as e:
        print(f"rlproxy connect: {e}; nothing written", file=sys.stderr)
        return 1
    if name is None:
        name = args.model or ModelSettings().model
        print(f"note: no server answered at {url}/v1/models; using the model name {name!r} and "
              "leaving the context window to the agent (run connect again once the server is "
              "up to fill them in)")
    model = args.model or name
    if adapter is not None:  # api/turns.py `model_name`: MODEL:ADAPTER names a personal adapter
        model = f"{model}:{adapter}"
    target = Target(url, model, key, context, cap)
    print(f"{agent.name} -> {target.openai_url}, model {target.model}"
          + (f", {context:,}-token window" if context else ""))
    rc = connect(args.agent, target, args.dry_run)
    if rc:
        return rc
    report_window(args.agent, context)
    report_budget(args.agent, target)
    found = shutil.which(agent.binary)
    print(f"run it: {agent.run}")
    print(f"{agent.binary}: " + (found or f"not found on PATH (install: {agent.install})"))
    if args.check and args.dry_run:
        print("--check skipped: a dry run writes no config for the agent to run with")
    elif args.check:
        return check.check(agent, target)
    return 0
