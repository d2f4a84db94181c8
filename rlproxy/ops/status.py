"""`rlproxy status`: one screen of plain text about a running server, from /healthz and the
dashboard's /ui/api/overview. Uses only the standard library, so it works from any shell."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

LAST_STEPS = 8


def fetch(url: str, key: str | None) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key
                                     else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 503:  # /healthz answers 503 with its body when the engine has failed
            return json.loads(e.read())
        raise


def num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.{digits}f}"


def render(health: dict, overview: dict | None) -> str:
    t, s = health["trainer"], health["scoring"]
    cache = health["prefix_cache"]
    lines = [f"rlproxy {health['status']}  model {health['model']}  adapter v"
             f"{health['adapter_version']}  up {health['uptime_s'] / 60:.0f} min  "
             f"BLAS {health['blas'].split()[0]}"]
    if health.get("error"):
        lines.append(f"  engine error: {health['error']}")
    eng = health["engine"]
    lines.append(f"serving   {eng['requests']} requests, {eng['tokens']} tokens, "
                 f"{eng['active']} decoding now")
    if cache.get("lookups") is not None:
        rate = cache["hits"] / cache["lookups"] if cache["lookups"] else None
        lines.append(f"cache     hit rate {num(rate, 2)} ({cache['hits']}/{cache['lookups']} "
                     f"lookups), {cache.get('disk_bytes', 0) / 2**20:.1f} MB on disk")
    else:
        lines.append(f"cache     off ({cache.get('reason')})")
    lines.append(f"sessions  {health['sessions_open']} open")
    lines.append(f"scoring   {s['method']}: {s['scored']} scored, {s['released']} released, "
                 f"{s['pending']} pending, {s['waiting']} waiting out a judge outage")
    if not t.get("enabled"):
        lines.append("trainer   off (--no-train)")
    else:
        state = ("error: " + t["error"] if t.get("error") else "stopped" if not t["alive"]
                 else "paused" if overview and overview["trainer"].get("paused") else "running")
        lines.append(f"trainer   {state}; step {t['step']}, {t['turns_trained']} turns trained, "
                     f"{t['queued']} queued, {t['skipped']} skipped, {t['quarantined']} "
                     "quarantined")
    if overview is not None:
        today = overview["today"]
        lines.append(f"today     {today.get('turns', 0)} turns in {today.get('sessions', 0)} "
                     f"sessions, {today.get('completion_tokens', 0)} tokens generated, "
                     f"{today.get('steps', 0)} steps")
        steps = overview["steps"][-LAST_STEPS:]
        if steps:
            lines.append(f"last {len(steps)} steps   step  reward   loss      kl")
            for st in steps:
                lines.append(f"          {st['step']:>9}  {num(st['reward_mean'], 2):>6}  "
                             f"{num(st['loss'], 4):>8}  {num(st['kl'], 4):>6}")
    return "\n".join(lines)


def status_cmd(args) -> int:
    url = args.url.rstrip("/")
    key = args.api_key or os.environ.get("RLPROXY_API_KEY")
    try:
        health = fetch(url + "/healthz", None)
    except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out
        print(f"rlproxy status: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    except ValueError:  # some other server on that port
        print(f"rlproxy status: {url}/healthz did not answer JSON: is it an rlproxy server?",
              file=sys.stderr)
        return 1
    try:
        overview = fetch(url + "/ui/api/overview", key)
    except urllib.error.HTTPError as e:
        overview = None
        if e.code == 401:
            print("(pass --api-key or set RLPROXY_API_KEY for the step history)",
                  file=sys.stderr)
    except (OSError, ValueError) as e:  # the server went away or answered garbage
        overview = None
        print(f"(no step history: {url}/ui/api/overview failed: {e})", file=sys.stderr)
    print(render(health, overview))
    print(time.strftime("as of %H:%M:%S"), f"- dashboard: {url}/ui")
    return 0
