"""Start-up against the size of the history: time and peak memory to build the pipeline's parts
(session store, scorer, trainer) from a data dir, in-process, through the real `build_pipeline`,
on synthetic histories of 1k, 10k and 100k agent-length turns, each written twice: with whole
turn lines, and with lines that extend the session's turn before (records.extending_line, what
the store writes by default since issue 37). Checkouts can run side by side (--trees, e.g. the
tree before issue 36's one-pass recovery on the whole form).

The history (written once per size and form under --data-root, then reused): sessions of 20 main
turns with explicit session ids; each turn a real `Turn.record()` line whose prompt grows as an
agent's does (half of --prompt-tokens at the first turn, plus a twentieth of it and an assistant
and tool message each turn: ~4,000 ids on average by default, an agent's tool loop rather than
its 15k-token first turn, to keep 100k whole turns on disk), its messages as text (~3.5
characters a token), 10 tool schemas, 256 completion ids with log-probs. Every turn scored by
the judge (3 votes), released (judging.release_lines), and trained in steps of 8 (training.jsonl
and train_journal.jsonl) except the last 64 releases; one feedback line per 500 turns. The last
4 sessions are open: their negative turns held, their last 2 turns unscored, one turn each
pending in the journal, which also holds the last 1,000 turns with their tombstones (what a
server leaves between two starts). Start-up compacts the journal, so a pristine copy is put back
before each run; the other files are left as they were. Both forms must give the same state.

Each (checkout, size) runs in a fresh process (PYTHONPATH = the checkout): the tiny model and
an engine are made first, then `build_pipeline` is timed. Figures: seconds, wall and CPU (the
process's, all threads: on a shared machine the wall clock also counts waiting); peak RSS
(getrusage ru_maxrss) and its growth over the RSS before the build; with --tracemalloc (sizes up
to --tracemalloc-max, a second run each: it slows allocation-heavy code) the peak of Python
allocations during the build (orjson 3.13 allocates ~1 MB for each turn the scorer packs,
whatever its length, and never touches most of it: that dominates this figure, equally in every
checkout, while RSS does not see it); and how many times each record file was read whole
(records.numbered_jsonl, which every reader goes through, counted per file). The trainer runs
with --no-resume: with no checkpoint to resume from, resume would retrain every recorded step.

Since conversations.jsonl's index (records.py: a short entry per line, written beside it as the
server runs), a start reads the index and only the lines it needs whole; `--first-start` also
measures a start without an index (a data dir from before it: that start reads every line and
writes the index), before the indexed one. `--compact` also starts on a copy compacted by
`rlproxy records compact` (closed, trained sessions moved to segments/; made once per tree).

    python bench/startup.py [--sizes 1000 10000 100000] [--prompt-tokens 4000]
        [--first-start] [--compact]
        [--forms whole extend] [--trees this=.] [--data-root /tmp/rlproxy-startup]
        [--tracemalloc] [--out bench/results/startup.json]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("conversations.jsonl", "prm_scores.jsonl", "pending_turns.jsonl", "training.jsonl",
         "train_journal.jsonl")
TURNS_PER_SESSION = 20
COMPLETION_TOKENS = 256
OPEN_SESSIONS = 4
UNTRAINED = 64  # the last releases, not trained yet: handed to the trainer at start
JOURNAL_WINDOW = 1000  # turns journaled (and tombstoned) since the last start
VOCAB = 49152
WORDS = ("the file function return value error test line self import path data config "
         "request result check build module class list dict string number open read write "
         "call tool output input update change fix run status session").split()


# ---- the synthetic history ----

def text(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def tool_schemas(rng: random.Random) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": text(rng, 200),
        "parameters": {"type": "object", "properties": {
            p: {"type": "string", "description": text(rng, 60)} for p in ("path", "query")},
            "required": ["path"]}}} for i in range(10)]


def write_history(data: Path, turns: int, prompt_tokens: int, extend: bool,
                  seed: int = 0) -> dict:
    """Write DATA's record files for TURNS turns (the module docstring), turn lines that extend
    the turn before (EXTEND) or whole; what was written. The same turns either way."""
    from rlproxy import records
    from rlproxy.records import dumps_line
    from rlproxy.scoring.judging import release_lines
    from rlproxy.sessions.turn import Turn

    rng = random.Random(seed)
    data.mkdir(parents=True, exist_ok=True)
    tools = tool_schemas(rng)
    # A session's prompt grows turn by turn, as an agent's does: turn i's prompt is the first
    # FIRST ids and 2 messages, plus GROW ids and an assistant/tool pair per turn before it
    # (the average over a session's 20 turns is about PROMPT_TOKENS). A few such sessions are
    # shared by many: parsing costs the same.
    first, grow = prompt_tokens // 2, prompt_tokens // TURNS_PER_SESSION
    chars = int(grow * 3.5)
    variants = []
    for _ in range(8):
        messages = [{"role": "system", "content": text(rng, int(first * 3.5) * 3 // 4)},
                    {"role": "user", "content": text(rng, int(first * 3.5) // 4)}]
        for i in range(TURNS_PER_SESSION):
            messages += [{"role": "assistant", "content": text(rng, chars // 4),
                          "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                              "name": "tool_1", "arguments": json.dumps({"path": "a/b.py"})}}]},
                         {"role": "tool", "tool_call_id": f"c{i}",
                          "content": text(rng, chars * 3 // 4)}]
        variants.append((
            [rng.randrange(VOCAB) for _ in range(first + grow * TURNS_PER_SESSION)], messages,
            [rng.randrange(VOCAB) for _ in range(COMPLETION_TOKENS)],
            [round(-rng.random() * 3, 6) for _ in range(COMPLETION_TOKENS)]))
    sessions, count = max(OPEN_SESSIONS + 1, turns // TURNS_PER_SESSION), TURNS_PER_SESSION
    files = {name: open(data / name, "wb") for name in FILES}
    journal, released, n, t0 = [], [], 0, 1.7e9
    try:
        for s in range(sessions):
            sid = f"agent-{s:06d}"
            is_open = s >= sessions - OPEN_SESSIONS
            for i in range(count):
                ids, messages, completion, logprobs = variants[s % len(variants)]
                ids, messages = ids[:first + grow * i], messages[:2 + 2 * i]
                last = i == count - 1
                turn = Turn(
                    uid=f"{sid}-{i:03d}", session_id=sid, index=i, turn_type="main",
                    requested_model="agent", messages=messages, tools=tools, prompt_ids=ids,
                    choices=[{"index": 0, "seed": n, "completion_ids": completion,
                              "logprobs": logprobs, "adapter_versions": [n // 8]
                              * COMPLETION_TOKENS, "finish_reason": "tool_calls",
                              "text": "", "tool_calls": [{"id": f"c{n}", "type": "function",
                                                          "function": {"name": "tool_2",
                                                                       "arguments": "{}"}}]}],
                    sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096},
                    timings={"received": t0 + n, "first_token_s": 0.4, "total_s": 6.1},
                    next_state=None if last else [
                        {"role": "tool", "tool_call_id": f"c{n}", "content": text(rng, 400)}],
                    next_state_link="prefix", end="session_done" if last and not is_open
                    else None, thread=f"th-{sid}")
                n += 1
                record = turn.record()
                # as sessions/store.py writes it: extending the session's turn before, whose
                # line starts at byte AT of conversations.jsonl (records.extending_line)
                line = (records.extending_line(record, parent, at, depth)
                        if extend and i > 0 else None) or record
                if is_open and last:  # waiting for its next state: in the journal only
                    journal.append({**line, "inferred": False})
                    continue
                f = files["conversations.jsonl"]
                parent, at, depth = record, f.tell(), line.get("extends", {}).get("depth", 0)
                f.write(dumps_line(line))
                if n > turns - JOURNAL_WINDOW:
                    journal += [{**line, "inferred": False}, {"kind": "done", "uid": turn.uid}]
                if is_open and i >= count - 3:
                    continue  # recorded, not scored yet
                reward = 1.0 if rng.random() < 0.6 else -1.0
                votes = [{"vote": int(reward), "text": text(rng, 300) + f" {int(reward)}",
                          "error": None} for _ in range(3)]
                score = {"kind": "score", "uid": turn.uid, "session_id": sid, "index": i,
                         "method": "rl", "chosen_choice": 0, "votes": votes, "verdict": None,
                         "judge_reward": reward, "function_reward": None, "reward": reward,
                         "teacher_logprobs": None, "feedback": None, "hint": None,
                         "teacher": None, "function_errors": [], "judged": True,
                         "judge_skipped": False, "judge_latency_s": 1.2,
                         "final": last and not is_open}
                files["prm_scores.jsonl"].write(dumps_line(score))
                if is_open and reward <= 0:
                    continue  # held until its session closes
                for line in release_lines(score, 1, reward, "scored" if reward > 0
                                          else "session_closed", "mean", with_others=True):
                    files["prm_scores.jsonl"].write(dumps_line(line))
                    released.append(line["key"])
                if n % 500 == 0:
                    files["prm_scores.jsonl"].write(dumps_line({
                        "kind": "feedback", "uid": turn.uid, "session_id": sid,
                        "reward": 1.0, "comment": None, "at": t0 + n}))
        trained = released[:-UNTRAINED]
        for step, at in enumerate(range(0, len(trained), 8), 1):
            uids = trained[at:at + 8]
            files["train_journal.jsonl"].write(dumps_line({
                "kind": "step_start", "n": step, "uids": uids, "attempt": 1,
                "tokens": len(uids) * (prompt_tokens + COMPLETION_TOKENS), "proven": True,
                "time": t0 + step}))
            files["train_journal.jsonl"].write(dumps_line({
                "kind": "step_end", "n": step, "ok": True, "error": None, "charged": True,
                "time": t0 + step}))
            files["training.jsonl"].write(dumps_line({
                "kind": "step", "step": step, "adapter_version": step, "uids": uids,
                "loss": 0.1, "reward_mean": 0.2, "tokens": len(uids) * COMPLETION_TOKENS,
                "step_s": 30.0, "time": t0 + step}))
        for entry in journal:
            files["pending_turns.jsonl"].write(dumps_line(entry))
    finally:
        for f in files.values():
            f.close()
    shutil.copy(data / "pending_turns.jsonl", data / "pending_turns.pristine")
    meta = {"turns": n, "prompt_tokens": prompt_tokens, "form": "extend" if extend else "whole",
            "released": len(released),
            "untrained": min(UNTRAINED, len(released)), "pending": OPEN_SESSIONS,
            "bytes": {name: (data / name).stat().st_size for name in FILES}}
    (data / "history.json").write_text(json.dumps(meta))
    return meta


def history(root: Path, turns: int, prompt_tokens: int, form: str) -> tuple[Path, dict]:
    data = root / f"turns-{turns}-tokens-{prompt_tokens}-{form}"
    meta_path = data / "history.json"
    if meta_path.exists():
        return data, json.loads(meta_path.read_text())
    shutil.rmtree(data, ignore_errors=True)
    tic = time.perf_counter()
    meta = write_history(data, turns, prompt_tokens, extend=form == "extend")
    print(f"wrote {turns} turns to {data} in {time.perf_counter() - tic:.0f} s "
          f"({sum(meta['bytes'].values()) / 2**30:.2f} GiB)", flush=True)
    return data, meta


# ---- one measured start-up, in a process of its own ----

def child(data: Path, traced: bool) -> dict:
    import resource
    import tracemalloc

    import rlproxy  # noqa: F401  (first: preloads OpenBLAS before mlx)
    import rlproxy.records as records

    reads: dict[str, int] = {}
    whole = records.numbered_jsonl

    def counted(path, *args, **kw):  # every reader goes through it (read_jsonl, load_pending)
        name = Path(path).name
        reads[name] = reads.get(name, 0) + 1
        return whole(path, *args, **kw)

    records.numbered_jsonl = counted  # before the modules that import it by name
    if hasattr(records, "IndexedFile"):  # conversations.jsonl, through its index
        through_index = records.IndexedFile.lines

        def counted_index(self):
            name = self.path.name + " (indexed)"
            reads[name] = reads.get(name, 0) + 1
            return through_index(self)

        records.IndexedFile.lines = counted_index
    from rlproxy.pipeline import build_pipeline
    from rlproxy.training.loop import Trainer

    submitted = []  # what the trainer is handed at start (its queue's name differs by version)
    offer = Trainer.submit
    Trainer.submit = lambda self, item: (submitted.append(item.get("key")), offer(self, item))
    from rlproxy.serving.engine import Engine
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import load_settings

    settings = load_settings({"data_dir": str(data), "model": "tiny", "train": True,
                              "judge": False, "resume": False}, environ={})
    loaded = load_serving_model(settings.model)
    engine = Engine(loaded.model, loaded.tokenizer.eos_token_ids)
    rss_before = rss_mb()
    if traced:
        tracemalloc.start()
    tic, cpu = time.perf_counter(), time.process_time()
    p = build_pipeline(settings, loaded, engine)
    seconds, cpu = time.perf_counter() - tic, time.process_time() - cpu
    traced_peak = tracemalloc.get_traced_memory()[1] / 2**20 if traced else None
    tracemalloc.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state = {"trainer_submitted": len(submitted), "scorer_queue": p.scorer.queue.qsize(),
             "scorer_held": len(p.scorer.held), "scorer_recent": len(p.scorer.recent),
             "open_sessions": len(p.store.open), "ledger_sessions": len(p.scorer.ledger.tallies)}
    p.store.close()
    p.trainer.stop()
    p.scorer.close()
    return {"seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3), "peak_rss_mb": round(peak, 1),
            "rss_before_mb": round(rss_before, 1), "rss_growth_mb": round(peak - rss_before, 1),
            "traced_peak_mb": None if traced_peak is None else round(traced_peak, 1),
            "reads": {name: n for name, n in reads.items() if n}, "state": state,
            "rlproxy": str(Path(rlproxy.__file__).parent)}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(tree: Path, data: Path, traced: bool, indexed: bool = True) -> dict:
    """One start-up of TREE on DATA. INDEXED: with conversations.jsonl's index as the run
    before left it (a server writes it as it runs; records.py); else without one, as a data dir
    from before issue 37's index is found (the start reads every line, and writes the index)."""
    shutil.copy(data / "pending_turns.pristine", data / "pending_turns.jsonl")
    if not indexed:
        (data / "conversations.jsonl.index").unlink(missing_ok=True)
    before = {name: (data / name).stat().st_size for name in FILES if name != FILES[2]}
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(data)]
                         + (["--traced"] if traced else []), cwd=tree, env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"start-up in {tree} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    after = {name: (data / name).stat().st_size for name in before}
    assert after == before, f"start-up changed the records: {before} -> {after}"
    assert Path(result["rlproxy"]) == tree / "rlproxy", result["rlproxy"]
    return result


def compacted(tree: Path, data: Path) -> Path:
    """A copy of DATA compacted by TREE's `rlproxy records compact` (made once, then reused)."""
    out = data.with_name(f"{data.name}-compacted-{tree.name}")
    if (out / "pending_turns.pristine").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(data, out)
    shutil.copy(out / "pending_turns.pristine", out / "pending_turns.jsonl")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    tic = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlproxy.cli", "records", "compact",
                           "--data-dir", str(out), "--model", "tiny"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"compacting {out} failed:\n{done.stderr[-3000:]}")
    print(f"compacted {out} in {time.perf_counter() - tic:.0f} s: {done.stdout.strip()}",
          flush=True)
    shutil.copy(out / "pending_turns.jsonl", out / "pending_turns.pristine")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--forms", nargs="+", choices=("whole", "extend"),
                    default=["whole", "extend"],
                    help="the history's turn lines: whole, or extending the turn before "
                         "(--extend-turns, the default since issue 37); the same turns")
    ap.add_argument("--trees", nargs="+", default=[f"this={HERE.parent}"],
                    help="LABEL=PATH checkouts to run, side by side; the first is the baseline")
    ap.add_argument("--data-root", type=Path, default=Path("/tmp/rlproxy-startup"))
    ap.add_argument("--tracemalloc", action="store_true",
                    help="a second run per size with tracemalloc (slow)")
    ap.add_argument("--tracemalloc-max", type=int, default=10000)
    ap.add_argument("--first-start", action="store_true",
                    help="also a start without conversations.jsonl's index (a data dir from "
                         "before it), measured before the indexed one")
    ap.add_argument("--compact", action="store_true",
                    help="also start on a copy compacted by `rlproxy records compact`")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "startup.json")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.traced)))
        return
    trees = {label: Path(path).resolve()
             for label, path in (tree.split("=", 1) for tree in args.trees)}
    load_before = os.getloadavg()[0]
    args.data_root.mkdir(parents=True, exist_ok=True)
    results = []
    for turns in args.sizes:
        for form in args.forms:
            need = turns * args.prompt_tokens * (12 if form == "whole" else 2)  # ~ the 5 files
            free = shutil.disk_usage(args.data_root).free
            if free < 2 * need:
                raise SystemExit(f"{args.data_root}: {free / 2**30:.1f} GiB free, "
                                 f"{need / 2**30:.1f} GiB needed for {turns} turns")
            data, meta = history(args.data_root, turns, args.prompt_tokens, form)
            row = {"turns": turns, "form": form, "history": meta}
            for label, tree in trees.items():  # side by side, on the same files
                if args.first_start:  # without the index; it leaves one for the run below
                    row[label + " first"] = first = run(tree, data, False, indexed=False)
                    print(f"{turns:>7} turns {form:>6} {label + ' first':>10}: "
                          f"{first['seconds']:8.2f} s ({first['cpu_seconds']:.2f} s CPU)  "
                          f"peak RSS {first['peak_rss_mb']:7.1f} MB  reads {first['reads']}",
                          flush=True)
                row[label] = run(tree, data, traced=False)
                if args.compact:  # the same history after `rlproxy records compact`
                    row[label + " compacted"] = c = run(tree, compacted(tree, data), False)
                    print(f"{turns:>7} turns {form:>6} {label + ' compacted':>10}: "
                          f"{c['seconds']:8.2f} s ({c['cpu_seconds']:.2f} s CPU)  peak RSS "
                          f"{c['peak_rss_mb']:7.1f} MB (+{c['rss_growth_mb']:.1f})  state "
                          f"{c['state']}", flush=True)
                if args.tracemalloc and turns <= args.tracemalloc_max:
                    row[label]["traced_peak_mb"] = run(tree, data, traced=True)["traced_peak_mb"]
                r = row[label]
                print(f"{turns:>7} turns {form:>6} {label:>10}: {r['seconds']:8.2f} s "
                      f"({r['cpu_seconds']:.2f} s CPU)  peak RSS {r['peak_rss_mb']:7.1f} MB "
                      f"(+{r['rss_growth_mb']:.1f})"
                      + (f"  traced {r['traced_peak_mb']:.1f} MB" if r["traced_peak_mb"] else "")
                      + f"  {sum(meta['bytes'].values()) / 2**20:,.0f} MB of records"
                      + f"  reads {r['reads']}", flush=True)
            base, *others = trees
            for label in others:  # the same state from the same files, whichever checkout
                assert row[label]["state"] == row[base]["state"], (label, row[label]["state"],
                                                                   row[base]["state"])
                row[label]["speedup"] = {k: round(row[base][k] / row[label][k], 2)
                                         for k in ("seconds", "cpu_seconds")}
            results.append(row)
        same = [r for r in results if r["turns"] == turns]
        for r in same[1:]:  # the same traffic gives the same state, whichever form it is in
            for label in trees:
                assert r[label]["state"] == same[0][label]["state"], (
                    turns, r["form"], r[label]["state"], same[0][label]["state"])
    out = {"load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
           "cpus": os.cpu_count(), "trees": {k: str(v) for k, v in trees.items()},
           "prompt_tokens": args.prompt_tokens, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
