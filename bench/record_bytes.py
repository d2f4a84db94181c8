"""Bytes on disk per recorded agent turn, with turn lines that extend the turn before
(records.py `extending_line`, `--extend-turns`, the default) and with every line whole
(`--no-extend-turns`).

    python bench/record_bytes.py [--turns 10] [--sessions 1] [--model tiny] [--tools N]
        [--keep DIR]
        [--out bench/results/record_bytes.json]

One Hermes-shaped agent session (bench/agent_workload.py: its system prompt, ~20 tool schemas,
then each request the last one plus the model's reply and a tool's result the size a real tool
returns; a model with a short context gets 2 tool schemas, SmolLM2's 8,192 tokens then hold
about 10 turns), TURNS requests at temperature 0 and 8 tokens a reply, the last marked
X-Session-Done, is sent to two fresh `rlproxy serve --no-train --no-judge` subprocesses, one per
form. Once every turn is recorded it measures each turn's line in conversations.jsonl and its
entry in pending_turns.jsonl (the journal holds every turn but the last, which is recorded at
once), and prints them per turn with the prompt tokens the server reported, then the ratio of
whole to extending bytes overall and after the first turn (which is whole in both) and bytes per
prompt token. With --sessions N, N such sessions of the same agent one after another (another
task each): a user's next session, whose first turn extends the last one recorded with the same
system prompt and tools; each session's bytes, and the ratio for the first and the later ones.
Writes it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_workload import SYSTEM_PROMPT, TASKS, TOOLS, tool_result  # noqa: E402
from common import environment, report  # noqa: E402
from rlproxy.ops.served import Served  # noqa: E402

FORMS = {"extending": ("--extend-turns",), "whole": ("--no-extend-turns",)}
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy


def chat(url: str, body: dict, headers: dict) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
    with DIRECT.open(request, timeout=600) as r:
        return json.loads(r.read())


def session(url: str, turns: int, tools: list[dict], n: int = 0) -> list[int]:
    """The agent's session N (its own id and task); each request's prompt tokens, as the
    server reported them."""
    rng, prompt_tokens = random.Random(n), []
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": TASKS[n % len(TASKS)]}]
    for step in range(turns):
        done = {"X-Session-Done": "1"} if step == turns - 1 else {}
        r = chat(url, {"model": "agent", "messages": messages, "tools": tools, "max_tokens": 8,
                       "temperature": 0}, {"X-Session-Id": f"bench-{n}", **done})
        prompt_tokens.append(r["usage"]["prompt_tokens"])
        reply = r["choices"][0]["message"]
        calls = reply.get("tool_calls") or []
        messages.append({"role": "assistant", "content": reply.get("content") or "",
                         **({"tool_calls": calls} if calls else {})})
        # a real model's tool calls get the tool's result; the tiny model's text, a user's turn
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(step, rng)}
                     for c in calls] or [{"role": "user", "content": tool_result(step, rng)}]
    return prompt_tokens


def lines(path: Path) -> list[tuple[dict, int]]:
    return [(json.loads(raw), len(raw) + 1) for raw in path.read_bytes().splitlines()
            if raw.strip()] if path.exists() else []


def measure(root: Path, form: str, flags: tuple, model: str, turns: int,
            tools: int | None, sessions: int = 1) -> dict:
    """Serve FORM, send the SESSIONS sessions one after another, wait until all their turns
    are recorded: bytes per turn (the first session's) and per session."""
    data = root / form
    with Served(data, "--no-train", "--no-judge", "--no-fsync", *flags, model=model,
                log=root / f"{form}.log", wait_s=600) as server:
        if tools is None:  # SmolLM2's 8,192 tokens hold the system prompt and 2 tools' schemas
            tools = len(TOOLS) if server.health()["context_length"] >= 32768 else 2
        tic = time.monotonic()
        try:
            prompt_tokens = session(server.url, turns, TOOLS[:tools])
            for n in range(1, sessions):
                session(server.url, turns, TOOLS[:tools], n)
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{form}: the server answered {e.code}: {e.read().decode()[:500]}")
        wall = time.monotonic() - tic
        deadline = time.monotonic() + 60
        while len(lines(data / "conversations.jsonl")) < turns * sessions:
            if time.monotonic() > deadline:
                raise SystemExit(f"{form}: {len(lines(data / 'conversations.jsonl'))} of "
                                 f"{turns} turns recorded after 60 s; see {server.log}")
            time.sleep(0.1)
        everything = lines(data / "conversations.jsonl")
        journal = lines(data / "pending_turns.jsonl")
    per_session = {}
    for line, size in everything:
        per_session[line["session_id"]] = per_session.get(line["session_id"], 0) + size
    conversations = sorted(((ln, n) for ln, n in everything if ln["session_id"] == "bench-0"),
                           key=lambda x: x[0]["index"])
    index = {line["uid"]: line["index"] for line, _ in conversations}
    pending = [0] * turns
    for line, size in journal:
        if line.get("kind") == "turn" and line["uid"] in index:  # the first session's
            pending[index[line["uid"]]] += size
    return {"session_s": round(wall, 1), "tools": tools, "prompt_tokens": prompt_tokens,
            "conversations_bytes": [size for _, size in conversations],
            "extends": [("extends" in line) for line, _ in conversations],
            "pending_turn_bytes": pending,
            "pending_file_bytes": (data / "pending_turns.jsonl").stat().st_size,
            "session_bytes": [per_session[f"bench-{n}"] for n in range(sessions)],
            "first_turn_extends": [any(ln["session_id"] == f"bench-{n}" and ln["index"] == 0
                                       and "extends" in ln for ln, _ in everything)
                                   for n in range(sessions)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--model", default="tiny", help="tiny or smollm2-135m-instruct (any --model)")
    p.add_argument("--tools", type=int, help="tool schemas sent (default: all %d; 2 on a model "
                   "with under 32k tokens of context)" % len(TOOLS))
    p.add_argument("--sessions", type=int, default=1,
                   help="sessions of the same agent, one after another (its system prompt and "
                        "tools, another task each): a later one's first turn extends the "
                        "earlier one's last (sessions/store.py), as a user's next session does")
    p.add_argument("--keep", type=Path, help="data dirs and server logs here (kept)")
    p.add_argument("--out", type=Path, default=Path("bench/results/record_bytes.json"))
    a = p.parse_args()

    load_before = os.getloadavg()[0]
    root = a.keep or Path(tempfile.mkdtemp(prefix="rlproxy-record-bytes-"))
    root.mkdir(parents=True, exist_ok=True)
    forms = {form: measure(root, form, flags, a.model, a.turns, a.tools, a.sessions)
             for form, flags in FORMS.items()}
    ext, whole = forms["extending"], forms["whole"]
    tokens = ext["prompt_tokens"]
    if tokens != whole["prompt_tokens"]:
        print(f"warning: the forms saw different prompts: {tokens} vs {whole['prompt_tokens']}")

    def total(form: dict, key: str, start: int = 0) -> int:
        return sum(form[key][start:])

    summary = {
        key: {"whole": total(whole, key), "extending": total(ext, key),
              "ratio": round(total(whole, key) / max(total(ext, key), 1), 2),
              "ratio_after_first": round(total(whole, key, 1) / max(total(ext, key, 1), 1), 2),
              "whole_bytes_per_prompt_token": round(total(whole, key) / sum(tokens), 2),
              "extending_bytes_per_prompt_token": round(total(ext, key) / sum(tokens), 2)}
        for key in ("conversations_bytes", "pending_turn_bytes")}
    table = [f"{a.turns} turns of a Hermes-shaped session ({ext['tools']} tools) on {a.model}; "
             "bytes per turn "
             "(conversations.jsonl line, pending_turns.jsonl entry)",
             f"{'turn':>4} {'prompt tok':>10} {'conv whole':>11} {'conv ext':>9} "
             f"{'pend whole':>11} {'pend ext':>9}"]
    for i in range(a.turns):
        table.append(f"{i:>4} {tokens[i]:>10} {whole['conversations_bytes'][i]:>11} "
                     f"{ext['conversations_bytes'][i]:>9} {whole['pending_turn_bytes'][i]:>11} "
                     f"{ext['pending_turn_bytes'][i]:>9}")
    for key, name in (("conversations_bytes", "conversations.jsonl"),
                      ("pending_turn_bytes", "pending_turns.jsonl (turn entries)")):
        s = summary[key]
        table.append(f"{name}: whole {s['whole']} B, extending {s['extending']} B: "
                     f"{s['ratio']}x overall, {s['ratio_after_first']}x after the first turn; "
                     f"{s['whole_bytes_per_prompt_token']} vs "
                     f"{s['extending_bytes_per_prompt_token']} B per prompt token")
    if a.sessions > 1:
        w, e = whole["session_bytes"], ext["session_bytes"]
        summary["session_bytes"] = {
            "whole": w, "extending": e, "first_turn_extends": ext["first_turn_extends"],
            "ratio_first": round(w[0] / e[0], 2),
            "ratio_later": round(sum(w[1:]) / max(sum(e[1:]), 1), 2)}
        table.append(f"{a.sessions} sessions of {a.turns} turns, bytes each: whole {w}, "
                     f"extending {e}: the first {summary['session_bytes']['ratio_first']}x, "
                     f"the later ones {summary['session_bytes']['ratio_later']}x (their first "
                     f"turns extend: {ext['first_turn_extends'][1:]})")
    table.append(f"prompt tokens: {sum(tokens)} in all; pending_turns.jsonl files: whole "
                 f"{whole['pending_file_bytes']} B, extending {ext['pending_file_bytes']} B; "
                 f"data in {root}")
    result = {**environment(a.model, load_before, settings={"turns": a.turns, "tools": ext["tools"],
                                                          "max_tokens": 8,
                                                          "sessions": a.sessions}),
              "summary": summary, "forms": forms}
    report(table, result, a.out)


if __name__ == "__main__":
    main()
