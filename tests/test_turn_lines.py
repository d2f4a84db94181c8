"""Turn lines that extend the turn before (records.py `extending_line`, `TurnLines`): the same
Hermes-shaped agent session (bench/agent_workload.py: its system prompt, ~20 tool schemas, tool
results the size a real tool returns) sent greedily to two real servers, one writing lines that
extend and one writing every line whole; every reader rebuilds the same records from both, and
the extending form is a fraction of the bytes."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow  # two servers, ten agent-length turns each

from rlproxy.cli import main
from rlproxy.paths import CONVERSATIONS, PENDING
from rlproxy.records import TurnLines, dumps_line, read_jsonl
from rlproxy.sessions.store import read_start
from rlproxy.training.items import released_turns

from conftest import ServerThread, make_settings, read_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from agent_workload import SYSTEM_PROMPT, TASKS, TOOLS, tool_result  # noqa: E402

TURNS = 8  # with the open session's 3: ~10 agent turns
SAME = ("index", "turn_type", "prompt_ids", "messages", "tools", "next_state", "trainable",
        "end", "chosen_choice")


def every_turn(turn, next_state):
    """A verifier's reward: +1 on even turns, -1 on odd ones."""
    return 1.0 if turn["index"] % 2 == 0 else -1.0


def agent_session(server: ServerThread, sid: str, turns: int, done: bool) -> None:
    """One agent session: each request is the last one plus the model's reply and a tool's
    result (as the user's message: the tiny model's replies are not tool calls)."""
    client, rng = server.client(), random.Random(0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TASKS[0]}]
    for step in range(turns):
        last = step == turns - 1
        r = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
            extra_headers={"X-Session-Id": sid, **({"X-Session-Done": "1"} if last and done
                                                   else {})})
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": tool_result(step, rng)}]


@pytest.fixture(scope="module")
def both(tiny, tmp_path_factory):
    """Data dirs of the same traffic: a done session and one still open (its last turn pending
    in the journal), written with lines that extend (`on`) and whole (`off`)."""
    dirs = {}
    for form, extend in (("on", True), ("off", False)):
        data = tmp_path_factory.mktemp(form)
        settings = make_settings(data, judge=False, extend_turns=extend,
                                 reward_functions=["test_turn_lines:every_turn"])
        with ServerThread(settings, tiny) as server:
            agent_session(server, "done", TURNS, done=True)
            agent_session(server, "open", 3, done=False)
            wait_scored(data, TURNS + 2)
        dirs[form] = data
    return dirs


def wait_scored(data: Path, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len([r for r in read_records(data, "prm_scores.jsonl") if r.get("kind") == "score"]) \
            < n:
        assert time.monotonic() < deadline, read_records(data, "prm_scores.jsonl")
        time.sleep(0.2)


def same(record: dict) -> dict:
    choice = record["choices"][record.get("chosen_choice", 0)]
    return {**{k: record.get(k) for k in SAME}, "session": record["session_id"],
            "completion_ids": choice["completion_ids"], "text": choice["text"]}


def test_lines_extend_and_rebuild_exactly_what_whole_lines_hold(both):
    on, off = (read_records(both[f]) for f in ("on", "off"))
    assert [same(r) for r in on] == [same(r) for r in off]
    assert len(on) == TURNS + 2
    raw = read_records(both["on"], raw=True)
    extending = [r for r in raw if "extends" in r]
    # the first turn is whole; every later one extends the one before in its session, and the
    # second session's first turn the first session's last (the same agent's long head)
    assert [r["session_id"] for r in raw if "extends" not in r] == ["done"]
    assert len(extending) == TURNS - 1 + 2, [r.get("index") for r in raw]  # 1 still pending
    by_uid = {r["uid"]: r for r in raw}
    first_open = next(r for r in extending if r["session_id"] == "open" and r["index"] == 0)
    assert by_uid[first_open["extends"]["uid"]]["session_id"] == "done"
    assert all("prompt_ids" not in r and "messages" not in r and "tools" not in r
               for r in extending)
    assert not any("extends" in r for r in read_records(both["off"], raw=True))


def test_the_journal_holds_only_what_is_new_and_a_restart_rebuilds_it(both):
    raw = [e for e in read_jsonl(both["on"] / PENDING) if e.get("kind") == "turn"]
    live = {e["uid"] for e in raw} - {e["uid"] for e in read_jsonl(both["on"] / PENDING)
                                      if e.get("kind") == "done"}
    pending = [e for e in raw if e["uid"] in live]
    assert len(pending) == 1 and "extends" in pending[0] and "prompt_ids" not in pending[0]
    starts = {f: read_start(both[f]) for f in ("on", "off")}
    (a,), (b,) = starts["on"].pending, starts["off"].pending
    assert {k: a[k] for k in ("index", "prompt_ids", "messages", "tools")} == \
        {k: b[k] for k in ("index", "prompt_ids", "messages", "tools")}


def test_train_from_gets_the_same_items_from_both_forms(both):
    items = {f: released_turns(both[f], 0.0, 1.0) for f in ("on", "off")}
    assert len(items["on"]) == len(items["off"]) >= TURNS - 1

    def key(item):
        return (same(item["turn"]), item.get("reward"), item.get("choice"))

    assert [key(i) for i in items["on"]] == [key(i) for i in items["off"]]


def test_extending_lines_are_a_fraction_of_the_bytes(both):
    """The agent's very first turn is whole in both; every turn after it, the second session's
    first included, is at least 10x smaller than its whole line."""
    sizes = {f: [len(line) for line in (both[f] / CONVERSATIONS).read_bytes().splitlines()]
             for f in ("on", "off")}
    on, off = (sum(sizes[f][1:]) for f in ("on", "off"))
    print(f"conversations.jsonl: whole {sum(sizes['off'])} bytes, extending "
          f"{sum(sizes['on'])}; after the first turn {off} vs {on} ({off / on:.1f}x)")
    assert sizes["on"][0] == pytest.approx(sizes["off"][0], rel=0.01)
    assert on * 10 < off, sizes


def test_a_missing_parent_is_reported_and_its_line_kept(both, tmp_path, caplog):
    path = tmp_path / CONVERSATIONS
    lines = (both["on"] / CONVERSATIONS).read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[1:]))  # the first turn's line lost
    with caplog.at_level("WARNING"):
        turns = TurnLines(path)
        rebuilt = [turns.full(line) for line in read_jsonl(path)]
    assert rebuilt[0] is None and turns.missing >= 1
    assert "cannot be read" in caplog.text
    assert path.read_bytes() == b"".join(lines[1:])  # nothing dropped from the file


def train_from(data: Path, out: Path) -> tuple[list[dict], dict]:
    """`rlproxy train --from DATA`, seed 0, a turn a step, turns past 15,100 tokens skipped: the
    done session's first turn (a whole line) and the open one's first are trained, the latter
    the deepest chain of lines that extend (an agent-length step on the tiny model costs ~8 s
    of CPU); no baseline, so both +1 turns carry signal: its training.jsonl lines and its
    adapter."""
    assert main(["train", "--from", str(data), "--model", "tiny", "--data-dir", str(out),
                 "--batch-size", "1", "--learning-rate", "1e-3", "--train-seed", "0",
                 "--max-context-tokens", "15100", "--baseline", "none",
                 "--log-level", "WARNING"]) == 0
    (ckpt,) = sorted((out / "checkpoints").glob("step_*"))
    return read_records(out, "training.jsonl"), mx.load(str(ckpt / "adapters.safetensors"))


def test_start_up_notes_lines_and_rebuilds_on_demand_what_full_lines_give(both, tmp_path,
                                                                         caplog):
    """What start-up recovery does (`TurnLines.note`: keep each line as read, rebuild it only if
    asked): a line whose parent was not read before it is reported and left out, as `full`
    does; every line kept rebuilds, on demand and in any order, exactly as reading the file
    whole in order does."""
    source = both["on"] / CONVERSATIONS
    reference = {r["uid"]: r for r in map(TurnLines(source).full, read_jsonl(source))}
    noted, seen = TurnLines(source), set()
    lines = list(read_jsonl(source))
    assert all(noted.note(line, seen) and not seen.add(line["uid"]) for line in lines)
    assert sum("extends" in line for line in lines) >= 4  # chains to walk, not whole lines
    for line in reversed(lines):  # last first: each rebuilt from noted lines, not in order
        rebuilt = noted.full(line)
        for k in ("prompt_ids", "messages", "tools"):
            assert rebuilt[k] == reference[line["uid"]][k], (line["uid"], k)

    path = tmp_path / CONVERSATIONS  # the first turn's line lost
    path.write_bytes(b"".join(source.read_bytes().splitlines(keepends=True)[1:]))
    cut, seen = TurnLines(path), set()
    with caplog.at_level("WARNING"):
        kept = [line for line in read_jsonl(path)
                if cut.note(line, seen) and not seen.add(line["uid"])]
    assert cut.missing >= 1 and "cannot be read" in caplog.text
    assert len(kept) < len(lines) - 1  # the lost turn's chain is left out, as `full` leaves it
    for line in kept:
        assert cut.full(line)["prompt_ids"] == reference[line["uid"]]["prompt_ids"]


def test_train_from_writes_the_same_adapter_bit_for_bit_from_either_form(both, tmp_path):
    """`rlproxy train --from` on the extending form's records and on the same records written
    whole (every line rebuilt and written in full: the only difference is the form) takes the
    same steps, skips the same turns and writes the same adapter, every tensor equal. (The
    other server's records, the `off` dir, are the same turns, but the log-probs it sampled
    with differ in the 5th digit: two servers, two prefix-cache histories; Adam's first steps
    make that up to ~3% of a LoRA tensor, so they are not compared here.)"""
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "prm_scores.jsonl").write_bytes((both["on"] / "prm_scores.jsonl").read_bytes())
    lines = TurnLines(both["on"] / CONVERSATIONS)
    (whole / CONVERSATIONS).write_bytes(b"".join(
        dumps_line(lines.full(line)) for line in read_jsonl(both["on"] / CONVERSATIONS)))
    assert not any("extends" in r for r in read_records(whole, raw=True))

    (on_lines, on), (whole_lines, rewritten) = (
        train_from(data, tmp_path / name) for name, data in (("on", both["on"]),
                                                              ("whole", whole)))
    fields = ("kind", "step", "loss", "turns", "uids", "reason")
    assert [{k: ln.get(k) for k in fields} for ln in on_lines] == \
        [{k: ln.get(k) for k in fields} for ln in whole_lines]
    assert len([ln for ln in on_lines if ln["kind"] == "step"]) >= 2, on_lines
    # one of them rebuilt through lines that extend: the training read the chains, not copies
    trained = {u for ln in on_lines if ln["kind"] == "step" for u in ln["uids"]}
    assert any("extends" in line and line["uid"] in trained
               for line in read_jsonl(both["on"] / CONVERSATIONS)), on_lines
    assert any(ln["kind"] == "skipped" for ln in on_lines), on_lines
    assert on.keys() == rewritten.keys() and on
    for k, v in on.items():
        assert mx.array_equal(v, rewritten[k]).item(), k
    # training moved the adapter (lora_b starts at 0): not two fresh ones compared
    assert any(mx.abs(v).max().item() > 0 for k, v in on.items() if "lora_b" in k)
