"""Judge accuracy: how well the PRM judge tells a good step from a bad one by its next state.

The cases are bench/data/next_states.jsonl: 189 next states written by the team (user approvals,
thanks, new requests; corrections, redo requests, complaints about length, format, language and
tone; shell, Python, test-runner, HTTP and file-read results, both ways; and ambiguous ones,
label 0), each in the split `tune` (the prompt's few-shot examples and the calibration were
chosen looking at these) or `test` (never looked at while tuning). Each case becomes a turn as
the scorer sees it, and is judged through rlproxy's own code: `scoring/judging.py` fills the
prompt and reads the verdict, `scoring/judges.py` runs it.

Judge modes:
- `logprob-local`: the default verdict. The base model (a LocalJudge) reads prm_prompts/
  verdict.txt, and the log-probs of the two label words at the label position are read in one
  forward pass.
- `logprob-url`: the same prompt through an OpenAI-compatible `/v1/completions` with
  `logprobs` (the bench starts mlx-lm's own server on the same model as the URL judge).
- `votes-local`, `votes-url`: the older judge: prm_prompts/judge.txt, sampled answers parsed for
  `\\boxed{}`, majority. Slow (hundreds of tokens per vote on a CPU), so by default on the first
  `--votes-cases` test cases with `--votes-m` votes of `--votes-max-tokens` tokens.

- `opd-direction`: not a judge but OPD's signal on the same cases: the base model as teacher
  with the next state appended to the prompt as hindsight (`scoring.hinted_messages`), minus
  the base model as student without it, per token of the assistant's output, averaged. OPD
  pushes a completion up where this is > 0, so it points the right way when the worked (+1)
  outputs get more than the failed (-1) ones. Prints the mean for each label, the share with
  the right sign and the AUC.

Per mode and split it prints: AUC of P(good) over the +1/-1 cases, accuracy on the +1/-1 cases
(a case counts right only if the verdict is decided and has the right sign), the share
undecided (all cases, and the label-0 cases alone, where undecided is right), the expected
calibration error (10 bins, +1/-1 cases) and the time per verdict. `--calibrate` fits the
calibration on the tune split (Platt scaling, compared with none and a bias alone) and writes
it into verdict.json for `--judge-name`.

    python bench/judge_accuracy.py [--modes logprob-local,logprob-url,votes-local]
                                   [--calibrate] [--out bench/results/judge_accuracy.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rlproxy.ops.served import free_port
from rlproxy.scoring import judging
from rlproxy.scoring.judges import LocalJudge, RemoteJudge
from rlproxy.settings import PRM_PROMPTS_DIR, ModelSettings, ScoringSettings

CASES = Path(__file__).resolve().parent / "data" / "next_states.jsonl"
DEFAULT_MIN_MARGIN = ScoringSettings().prm_min_margin


def load_cases(path: Path = CASES) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def as_turn(case: dict) -> dict:
    """A case as the scorer's turn record: the request, one choice, the next state."""
    out = case["assistant_output"]
    calls = [{"function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in out["tool_calls"]]
    return {"messages": [{"role": "user", "content": case["user_request"]}],
            "choices": [{"text": out["text"], "tool_calls": calls}],
            "chosen_choice": 0, "next_state": case["next_state"]}


# ---- metrics ----

def auc(scores: list[float], labels: list[int]) -> float | None:
    """P(a random +1 case scores above a random -1 case), ties half."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == -1]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def ece(probs: list[float], labels: list[int], bins: int = 10) -> float | None:
    """Expected calibration error of P(good) against label == +1, over the +1/-1 cases."""
    pairs = [(p, y == 1) for p, y in zip(probs, labels) if y in (1, -1)]
    if not pairs:
        return None
    total = 0.0
    for b in range(bins):
        inside = [(p, y) for p, y in pairs if b / bins <= p < (b + 1) / bins or (
            b == bins - 1 and p == 1.0)]
        if inside:
            gap = abs(sum(p for p, _ in inside) / len(inside) - sum(y for _, y in inside)
                      / len(inside))
            total += gap * len(inside) / len(pairs)
    return total


def summarize(rows: list[dict]) -> dict:
    """Figures of one mode on one set of cases (rows: label, p_good, reward, seconds)."""
    signed = [r for r in rows if r["label"] in (1, -1)]
    zero = [r for r in rows if r["label"] == 0]
    right = sum(r["reward"] is not None and (r["reward"] > 0) == (r["label"] == 1)
                for r in signed)
    probs = [0.5 if r["p_good"] is None else r["p_good"] for r in signed]
    return {
        "cases": len(rows),
        "auc": auc(probs, [r["label"] for r in signed]),
        "accuracy_pm1": right / len(signed) if signed else None,
        "undecided": sum(r["reward"] is None for r in rows) / len(rows) if rows else None,
        "undecided_label0": (sum(r["reward"] is None for r in zero) / len(zero)
                             if zero else None),
        "ece": ece(probs, [r["label"] for r in signed]),
        "seconds_per_verdict": sum(r["seconds"] for r in rows) / len(rows) if rows else None,
    }


# ---- calibration ----

def fit_platt(zs: list[float], ys: list[bool], iters: int = 200) -> dict:
    """scale, bias minimizing the log loss of sigmoid(scale * z + bias) (Newton's method on
    two parameters, a small ridge keeping it finite on separable data)."""
    a, b, ridge = 1.0, 0.0, 1e-3
    for _ in range(iters):
        ga = gb = haa = hab = hbb = 0.0
        for z, y in zip(zs, ys):
            p = judging.calibrated(z, {"scale": a, "bias": b})
            w = p * (1 - p)
            ga, gb = ga + (p - y) * z, gb + (p - y)
            haa, hab, hbb = haa + w * z * z, hab + w * z, hbb + w
        ga, haa, hbb = ga + ridge * a, haa + ridge, hbb + ridge
        det = haa * hbb - hab * hab
        if det <= 0:
            break
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        a, b = a - da, b - db
        if abs(da) + abs(db) < 1e-9:
            break
    return {"scale": round(a, 4), "bias": round(b, 4)}


def fit_bias(zs: list[float], ys: list[bool]) -> dict:
    """The bias alone (scale 1): the threshold on z that gets the most cases right, moved to
    0 (the midpoint between the neighbouring scores)."""
    ordered = sorted(zs)
    cuts = [ordered[0] - 1] + [(x + y) / 2 for x, y in zip(ordered, ordered[1:])]
    best = max(cuts, key=lambda t: sum((z > t) == y for z, y in zip(zs, ys)))
    return {"scale": 1.0, "bias": round(-best, 4)}


def calibration_report(tune: list[dict]) -> dict:
    """Each method fitted on the tune split, judged by leave-one-out log loss and accuracy on
    the same split (the test split is never used to choose)."""
    signed = [r for r in tune if r["label"] in (1, -1) and r["z"] is not None]
    zs, ys = [r["z"] for r in signed], [r["label"] == 1 for r in signed]
    fits = {"none": lambda z, y: None, "bias": fit_bias, "platt": fit_platt}
    out = {}
    for name, fit in fits.items():
        loss = right = 0.0
        for k in range(len(zs)):
            c = fit(zs[:k] + zs[k + 1:], ys[:k] + ys[k + 1:])
            p = min(max(judging.calibrated(zs[k], c), 1e-6), 1 - 1e-6)
            loss -= math.log(p if ys[k] else 1 - p)
            right += (p > 0.5) == ys[k]
        out[name] = {"fit": fit(zs, ys), "loo_log_loss": loss / len(zs),
                     "loo_accuracy": right / len(zs)}
    return out


# ---- running a judge ----

async def judge_logprob(judge, prompts: dict, calibration: dict | None, min_margin: float,
                        cases: list[dict]) -> list[dict]:
    labels = prompts["verdict_json"]["labels"]
    rows = []
    for case in cases:
        text = judging.fill_verdict_prompt(prompts["verdict_txt"], as_turn(case), 4000)
        tic = time.perf_counter()
        top = await judge.verdict(text, list(labels))
        seconds = time.perf_counter() - tic
        if top is None:
            raise SystemExit("the judge URL gave no log-probs")
        v = judging.read_verdict(top, labels, calibration, min_margin)
        lps = judging.label_logprobs(top, labels)
        rows.append({"id": case["id"], "label": case["label"], "split": case["split"],
                     "z": None if lps is None else lps[1] - lps[-1], "p_good": v["p_good"],
                     "reward": v["reward"], "seconds": seconds})
    return rows


def opd_direction(model, tokenizer, cases: list[dict]) -> list[dict]:
    """Per +1/-1 case: the mean over the output's tokens of log p_teacher - log p_student, the
    teacher being the model given the next state as a hint."""
    from rlproxy.serving.chat_template import render_prompt
    from rlproxy.serving.logprobs import sequence_logprobs

    rows = []
    for case in cases:
        if case["label"] not in (1, -1):
            continue
        turn = as_turn(case)
        completion = tokenizer.encode(judging.assistant_output(turn["choices"][0]),
                                      add_special_tokens=False)
        hint = judging.render_next_state(case["next_state"], judging.VERDICT_STATE_CHARS)
        tic = time.perf_counter()
        gaps = []
        for messages in (judging.hinted_messages(turn["messages"], hint), turn["messages"]):
            prompt = render_prompt(tokenizer, messages, None)
            gaps.append(sequence_logprobs(model, prompt + completion, start=len(prompt)))
        advantage = (gaps[0] - gaps[1]).mean().item()
        rows.append({"id": case["id"], "label": case["label"], "split": case["split"],
                     "advantage": advantage, "seconds": time.perf_counter() - tic})
    return rows


def summarize_opd(rows: list[dict]) -> dict:
    good = [r["advantage"] for r in rows if r["label"] == 1]
    bad = [r["advantage"] for r in rows if r["label"] == -1]
    right = sum((r["advantage"] > 0) == (r["label"] == 1) for r in rows)
    return {"cases": len(rows), "mean_advantage_good": sum(good) / len(good),
            "mean_advantage_bad": sum(bad) / len(bad), "right_sign": right / len(rows),
            "auc": auc([r["advantage"] for r in rows], [r["label"] for r in rows])}


async def judge_votes(judge, prompts: dict, cases: list[dict], m: int, max_tokens: int,
                      temperature: float) -> list[dict]:
    rows = []
    for case in cases:
        text = judging.fill_prompt(prompts["judge_txt"], as_turn(case), 4000)
        tic = time.perf_counter()
        answers = [await judge.complete([{"role": "user", "content": text}], temperature,
                                        max_tokens, seed) for seed in range(m)]
        seconds = time.perf_counter() - tic
        votes = [judging.parse_vote(a) for a in answers]
        r = judging.majority(votes)
        valid = [v for v in votes if v is not None]
        rows.append({"id": case["id"], "label": case["label"], "split": case["split"],
                     "z": None, "p_good": (sum(v == 1 for v in valid) / len(valid)
                                           if valid else None),
                     "reward": r if r != 0 else None, "votes": votes, "seconds": seconds})
    return rows


class MlxLmServer:
    """mlx-lm's own OpenAI-compatible server on the model, as a judge URL (started after
    `import rlproxy`, which preloads the same BLAS as the local judge has: without it MLX's
    Linux wheel computes with its reference BLAS, ~30x slower)."""

    def __init__(self, path: str):
        self.port = free_port()
        start = "import rlproxy; from mlx_lm.server import main; main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", start, "--model", path, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise SystemExit("mlx_lm.server did not start")
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


async def run(args) -> dict:
    from rlproxy.serving.model import load_base_model, resolve_model_path

    prompts = judging.load_prompts(args.prm_prompts)
    cases = load_cases(args.cases)
    splits = {s: [c for c in cases if c["split"] == s] for s in ("tune", "test")}
    calibration = prompts["verdict_json"]["calibration"].get(args.judge_name)
    modes = args.modes.split(",")
    results: dict = {"cases": {s: len(c) for s, c in splits.items()},
                     "min_margin": args.min_margin, "judge_name": args.judge_name,
                     "calibration": calibration, "modes": {}}
    local = server = remote = None
    try:
        if any(m.endswith("-local") or m == "opd-direction" for m in modes):
            model, tokenizer = load_base_model(ModelSettings(model=args.model))
            local = LocalJudge(model, tokenizer, yield_ms=0)
        if any(m.endswith("-url") for m in modes):
            server = MlxLmServer(resolve_model_path(ModelSettings(model=args.model))[0])
            remote = RemoteJudge(server.url, "default_model", None, 120.0, 1)  # mlx-lm: its model
        for mode in modes:
            if mode == "opd-direction":
                model, tokenizer = local.model, local.tokenizer  # the judge thread is idle
                rows = opd_direction(model, tokenizer, cases)
                out = {s: summarize_opd([r for r in rows if r["split"] == s])
                       for s in ("tune", "test")}
                results["modes"][mode] = {**out, "rows": rows}
                for s, f in out.items():
                    print(f"opd-direction  {s:4s} n={f['cases']:3d}  teacher - student "
                          f"log-prob per token: worked {f['mean_advantage_good']:+.3f}, failed "
                          f"{f['mean_advantage_bad']:+.3f}; right sign {f['right_sign']:.1%}; "
                          f"AUC {fmt(f['auc'])}", flush=True)
                continue
            judge = local if mode.endswith("-local") else remote
            if mode.startswith("logprob"):
                rows = await judge_logprob(judge, prompts, calibration, args.min_margin, cases)
            else:
                picked = splits["test"][:args.votes_cases]
                rows = await judge_votes(judge, prompts, picked, args.votes_m,
                                         args.votes_max_tokens, args.votes_temperature)
            by = {s: [r for r in rows if r["split"] == s] for s in ("tune", "test")}
            results["modes"][mode] = {s: summarize(r) for s, r in by.items() if r}
            results["modes"][mode]["rows"] = rows
            for s, figures in results["modes"][mode].items():
                if s != "rows":
                    print(line(mode, s, figures), flush=True)
            if mode == "logprob-local" and args.calibrate:
                report = calibration_report(by["tune"])
                results["calibration_methods"] = report
                for name, r in report.items():
                    print(f"  calibration {name:5s} fit={r['fit']} leave-one-out on tune: "
                          f"log loss {r['loo_log_loss']:.3f}, accuracy "
                          f"{r['loo_accuracy']:.1%}")
                chosen = min(report, key=lambda k: report[k]["loo_log_loss"])
                fit = report[chosen]["fit"] or {"scale": 1.0, "bias": 0.0}
                write_calibration(args.prm_prompts, args.judge_name, fit, chosen)
                results["calibration_chosen"] = {"method": chosen, **fit}
                print(f"  wrote {chosen} calibration {fit} for {args.judge_name!r} into "
                      f"{args.prm_prompts / 'verdict.json'}; rerun without --calibrate to see "
                      "its figures")
    finally:
        if local is not None:
            local.close()
        if remote is not None:
            await remote.close()
        if server is not None:
            server.stop()
    return results


def write_calibration(folder: Path, name: str, fit: dict, method: str) -> None:
    path = folder / "verdict.json"
    config = json.loads(path.read_text())
    config.setdefault("calibration", {})[name] = {**fit, "method": method,
                                                  "fitted_on": "bench/data/next_states.jsonl "
                                                  "split tune"}
    path.write_text(json.dumps(config, indent=2) + "\n")


def fmt(x, pct=False):
    return "  -  " if x is None else (f"{x:.1%}" if pct else f"{x:.3f}")


def line(mode: str, split: str, f: dict) -> str:
    return (f"{mode:14s} {split:4s} n={f['cases']:3d}  AUC {fmt(f['auc'])}  accuracy(+-1) "
            f"{fmt(f['accuracy_pm1'], True)}  undecided {fmt(f['undecided'], True)} "
            f"(label 0: {fmt(f['undecided_label0'], True)})  ECE {fmt(f['ece'])}  "
            f"{f['seconds_per_verdict']:.2f} s/verdict")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="logprob-local,logprob-url,votes-local")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--judge-name", default="smollm2-135m-instruct",
                   help="the calibration's key in verdict.json (the judge model's name)")
    p.add_argument("--prm-prompts", type=Path, default=PRM_PROMPTS_DIR)
    p.add_argument("--cases", type=Path, default=CASES)
    p.add_argument("--min-margin", type=float, default=DEFAULT_MIN_MARGIN)
    p.add_argument("--calibrate", action="store_true",
                   help="fit the calibration on the tune split and write it to verdict.json")
    p.add_argument("--votes-cases", type=int, default=24)
    p.add_argument("--votes-m", type=int, default=3)
    p.add_argument("--votes-max-tokens", type=int, default=64)
    p.add_argument("--votes-temperature", type=float, default=0.6)
    p.add_argument("--out", type=Path, default=Path("bench/results/judge_accuracy.json"))
    args = p.parse_args()
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
