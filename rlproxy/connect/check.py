"""`rlproxy connect --check AGENT`: run one short non-interactive turn through the installed agent
and say where it landed on the server (session, thread, api), read from GET /v1/sessions before
and after. Writes no config (command.py does) and judges no reply (tiny's are noise)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import urllib.error

from rlproxy.connect.agents import Agent, Target
from rlproxy.ops.status import fetch

TIMEOUT_S = 900  # a 2-core CPU took ~3.5 minutes over Claude Code's first 36k-token prompt


def sessions(target: Target) -> dict[str, dict]:
    data = fetch(f"{target.url}/v1/sessions", target.api_key)["data"]
    return {s["id"]: s for s in data}


def new_turns(target: Target, before: dict[str, dict]) -> list[tuple[str, dict]]:
    """(session id, turn summary) for each turn placed since `before` (turn indexes are given
    in order of arrival within a session)."""
    found = []
    for sid, s in sessions(target).items():
        was = before.get(sid)
        if was and (was["turns"], was["last_active"]) == (s["turns"], s["last_active"]):
            continue
        detail = fetch(f"{target.url}/v1/sessions/{sid}", target.api_key)
        found += [(sid, t) for t in detail["turn_list"] if t["index"] >= (was or {}).get(
            "turns", 0)]
    return found


def check(agent: Agent, target: Target) -> int:
    binary = shutil.which(agent.binary)
    if binary is None:
        print(f"--check: {agent.binary} is not installed (install: {agent.install})",
              file=sys.stderr)
        return 1
    try:
        before = sessions(target)
    except urllib.error.HTTPError as e:  # a URLError too: it answered, and said no
        wants = " (it was started with --api-key: pass the same key with --api-key)" if (
            e.code in (401, 403)) else ""
        print(f"--check: the server at {target.url} answered {e.code} to GET /v1/sessions"
              f"{wants}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"--check: the server at {target.url} does not answer ({e}); start it with "
              "`rlproxy serve` first", file=sys.stderr)
        return 1
    print(f"running {shlex.join(agent.check)} (up to {TIMEOUT_S // 60} min: a CPU prefills an "
          "agent's first prompt slowly)", flush=True)
    try:
        done = subprocess.run([binary, *agent.check[1:]], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, out = done.returncode, (done.stdout or "") + (done.stderr or "")
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= said
        rc, out = "timed out", "".join((b or b"").decode("utf-8", errors="replace")
                                       for b in (e.stdout, e.stderr))
    tail = "\n".join(out.strip().splitlines()[-5:])
    print(f"{agent.binary} exited {rc}" + (f"; its last lines:\n{tail}" if tail else ""))
    landed = new_turns(target, before)
    for sid, t in landed:
        print(f"landed: session {sid}, thread {t['thread']}, api {t['api']}, "
              f"{t['turn_type']} turn #{t['index']}, {t['prompt_tokens']} prompt + "
              f"{t['completion_tokens']} completion tokens")
    if not landed:
        print("no turn landed on the server: see the agent's output above", file=sys.stderr)
        return 1
    return 0
