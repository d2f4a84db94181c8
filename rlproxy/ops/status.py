"""`rlproxy status`: one screen of plain text about a running server, from /healthz and the
dashboard's /ui/api/overview. Uses only the standard library, so it works from any shell.

Also owns the words for "is it learning?" that the dashboard shows too (ui/views.py sends them):
the trainer's state and why it waits (`trainer_state`), the judge's health (`judge_lines`) and
the held-out reward of the eval gate (`held_out_line`), each a pure function of the dicts the
server answers."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

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


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def share(x: float | None) -> str:
    return "" if x is None else f" ({x:.0%})"


@dataclass(frozen=True)
class TrainerState:
    """What the trainer is doing. KIND: off, paused, error, stopped, idle (nothing released to
    train, nothing being scored), waiting (some turns, not a batch yet) or training (a batch is
    there); WORDS: what the dashboard's header says ("waiting for 2 more turns"); WHY: the
    sentence that says what it waits for, or None."""

    kind: Literal["off", "paused", "error", "stopped", "idle", "waiting", "training"]
    words: str
    why: str | None = None


def trainer_state(t: dict, scoring: dict) -> TrainerState:
    """T: /healthz's "trainer" (with `untrained` and `batch_size`), SCORING: its "scoring".
    Training means a batch is there: the released turns not trained yet (those of a step under
    way included) fill one."""
    if not t.get("enabled"):
        return TrainerState("off", "off")
    for kind in ("paused", "error"):
        if t.get(kind):
            return TrainerState(kind, kind)
    if not t["alive"]:
        return TrainerState("stopped", "stopped")
    have, need, scoring_now = t["untrained"], t["batch_size"], scoring["pending"]
    if have >= need:
        return TrainerState("training", "training")
    if have == 0 and not scoring_now:
        return TrainerState("idle", "idle")
    words = f"waiting for {plural(need - have, 'more turn')}"
    why = f"{words}: {have} of {need} released turns for the next step"
    if scoring_now:
        why += f"; scoring is the bottleneck: {plural(scoring_now, 'turn')} not scored yet"
    return TrainerState("waiting", words, why)


def judge_lines(s: dict) -> list[str]:
    """The judge's health from /healthz's "scoring": its verdicts, what at-least-one lifted, and
    how often it agrees with the people who gave feedback."""
    j = s["judge"]
    if s["verdict"] is None:
        return ["judge     off (rewards come from reward functions and feedback)"]
    both = j["feedback_agree"] + j["feedback_disagree"]
    agrees = f"; agrees with feedback {j['feedback_agree']} of {both}" if both else ""
    return [f"judge     {s['verdict']}: {j['good']} worked / {j['bad']} failed / "
            f"{j['undecided']} undecided{share(j['undecided_share'])}, {j['skipped']} skipped",
            f"          at-least-one lifted {j['lifted']} of {j['released']} released"
            f"{share(j['lifted_share'])}{agrees}"]


HELD_OUT_OFF = ("held-out  off: --eval-every N with --eval-prompts FILE and "
                "--eval-reward-functions module:fn")


def held_out_line(evals: list[dict], eval_every: int | None) -> str:
    """The eval gate's reward on its probes (the overview's `evals`), last and first, or what
    turns the gate on. EVAL_EVERY: the trainer's --eval-every (None or 0: off)."""
    if not evals:
        return (f"held-out  no evaluations yet (the eval gate runs every "
                f"{plural(eval_every, 'step')})" if eval_every else HELD_OUT_OFF)
    refused = sum(1 for e in evals if not e["passed"])
    count = plural(len(evals), "eval") + (f", {refused} refused" if refused else "")
    rewarded = [e for e in evals if e["reward"] is not None]
    if not rewarded:
        return f"held-out  no reward measured ({count})"  # no function answered, or failed
    first, last = rewarded[0], rewarded[-1]
    return (f"held-out  reward {last['reward']:+.2f} at step {last['step']} (first eval "
            f"{first['reward']:+.2f} at step {first['step']}; {count})")


def render(health: dict, overview: dict | None) -> str:
    t, s = health["trainer"], health["scoring"]
    cache = health["prefix_cache"]
    lines = [f"rlproxy {health['status']}  model {health['model']}  adapter v"
             f"{health['adapter_version']}  up {health['uptime_s'] / 60:.0f} min  "
             f"BLAS {health['blas'].split()[0]}"]
    if health.get("error"):
        lines.append(f"  engine error: {health['error']}")
    eng = health["engine"]
    memory = health.get("memory") or {}  # a server from before issue 41 says none
    lines.append(f"serving   {eng['requests']} requests, {eng['tokens']} tokens, "
                 f"{eng['active']} decoding now" + (
                     f"; memory {num(memory['rss_gib'], 2)} GiB (peak "
                     f"{num(memory['peak_rss_gib'], 2)})" if memory else ""))
    if cache.get("lookups") is not None:
        rate = cache["hits"] / cache["lookups"] if cache["lookups"] else None
        lines.append(f"cache     hit rate {num(rate, 2)} ({cache['hits']}/{cache['lookups']} "
                     f"lookups), {cache.get('disk_bytes', 0) / 2**20:.1f} MB on disk")
    else:
        lines.append(f"cache     off ({cache.get('reason')})")
    lines.append(f"sessions  {health['sessions_open']} open")
    lines.append(f"scoring   {s['method']}: {s['scored']} scored, {s['released']} released, "
                 f"{s['pending']} pending, {s['waiting']} waiting out a judge outage")
    lines += judge_lines(s)
    state = trainer_state(t, s)
    if state.kind == "off":
        lines.append("trainer   off (--no-train)")
    else:
        figures = (f"step {t['step']}, {t['turns_trained']} turns trained, {t['untrained']} to "
                   f"train, {t['skipped']} skipped, {t['quarantined']} quarantined")
        if state.why:
            lines += [f"trainer   {state.why}", f"          {figures}"]
        else:
            lines.append(f"trainer   {'error: ' + t['error'] if t.get('error') else state.words}"
                         f"; {figures}")
    personal = (health.get("adapters") or {}).get("adapters") or {}
    for name in (health.get("adapters") or {}).get("resting") or []:
        lines.append(f"adapter   {name}: resting on disk (its next request brings it back)")
    for name, a in sorted(personal.items()):  # personal adapters: a line each
        at = a["trainer"]
        training = ("not training" if at is None else f"error: {at['error']}" if at["error"]
                    else f"step {at['step']}, {at['turns_trained']} turns trained, "
                    f"{at['untrained']} to train" + (", paused" if at["paused"] else ""))
        lines.append(f"adapter   {name}: version {a['version']}, {a['sessions_open']} open "
                     f"sessions, {training}")
    if overview is not None:
        lines.append(held_out_line(overview["evals"], overview["trainer"].get("eval_every")))
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
