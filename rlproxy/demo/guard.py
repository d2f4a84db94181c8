"""`rlproxy demo --guard`: the demo with the eval gate on and a learning rate set too high.

What it adds to demo/run.py: the gate's settings (an evaluation every EVAL_EVERY steps on PROBES
held-out weather conversations written to `probes.jsonl`, scored with the demo's own reward,
and a KL bound), the gate's news read from training.jsonl as it happens (one printed line per
evaluation and per rollback), and the gate's summary and marks for curve.json and the chart.
Serving, scoring, training and the gate are the real modules, unchanged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlproxy import paths
from rlproxy.records import read_jsonl

# Too high on purpose, on both kinds of model: the demo's tuned rates are 1e-3 (tiny) and 1e-4
# (SmolLM2) (demo/run.py). Measured here (batches of 8, every step evaluated): one step at 2e-2,
# 1e-2 and 5e-3 moved the policy by 1.08, 1.01 and 0.87 nats per token on the tiny model (KL to
# the served adapter on the probes; one at 1e-3 by 0.06-0.23), and by 9.95, 5.04 and 1.95 on
# SmolLM2-135M-Instruct (whose probe reward also fell, -0.71 to -1.00..-0.90). So with MAX_KL the
# gate refuses the first three candidates, halving the rate each time, and pauses training after
# the third: the served adapter never changes.
GUARD_LEARNING_RATE = 2e-2
EVAL_EVERY = 1  # every step: the agent's next round is sampled by the adapter just judged
PROBES = 8
MAX_KL = 0.6
MAX_ROLLBACKS = 3
TOLERANCE = 0.15


def guard_flags(out: Path, opening) -> dict:
    """The gate's settings; writes the held-out probe conversations (other seeds than the
    agent's and the measurement's)."""
    path = out / "probes.jsonl"
    path.write_text("".join(json.dumps({"messages": opening(random.Random(20_000 + i))}) + "\n"
                            for i in range(PROBES)))
    return {"eval_every": EVAL_EVERY, "eval_prompts": str(path), "eval_probes": PROBES,
            "max_kl": MAX_KL, "max_rollbacks": MAX_ROLLBACKS, "eval_tolerance": TOLERANCE}


class GateNews:
    """The gate's `eval` and `rollback` lines in DATA_DIR's training.jsonl not yet seen."""

    def __init__(self, data_dir: Path):
        self.path, self.seen = Path(data_dir) / paths.TRAINING, 0

    def new(self) -> list[dict]:
        lines = [ln for ln in read_jsonl(self.path) if ln.get("kind") == "eval"
                 or (ln.get("kind") == "rollback" and ln.get("gate"))]
        fresh, self.seen = lines[self.seen:], len(lines)
        return fresh


def describe(line: dict) -> str:
    """One printed line of the text curve for an evaluation or a rollback."""
    if line["kind"] == "rollback":
        return (f"step {line['step']:3d}  ROLLBACK to step {line['checkpoint_step']} "
                f"(adapter v{line['adapter_version']}): {line['reason']}; learning rate now "
                f"x{line['lr_scale']:g} = {line['next_learning_rate']:.2g}")
    cand, served = line.get("candidate") or {}, line.get("served") or {}
    verdict = (f"published as v{line['candidate_version']}" if line["passed"]
               else "refused")
    return (f"step {line['step']:3d}  gate: candidate {verdict}; probe reward "
            f"{_num(cand.get('reward'))} vs served {_num(served.get('reward'))}; KL to served "
            f"{_num(cand.get('kl_served'), '.2f')}, to base {_num(cand.get('kl_base'), '.2f')}; "
            f"repeats {_num(cand.get('repeat_rate'), '.2f')}")


def _num(x, spec: str = "+.3f") -> str:
    return "-" if x is None else format(x, spec)


def gate_summary(data_dir: Path) -> dict:
    """The gate's evaluations and rollbacks in DATA_DIR's training.jsonl, for curve.json."""
    news = GateNews(data_dir).new()
    evals = [ln for ln in news if ln["kind"] == "eval"]
    return {"evaluations": len(evals), "published": sum(ln["passed"] for ln in evals),
            "rollbacks": [{"step": ln["step"], "reason": ln["reason"],
                           "lr_scale": ln["lr_scale"]} for ln in news if ln["kind"] == "rollback"],
            "probe_rewards": [{"step": ln["step"], "reward": ln["candidate"]["reward"],
                               "served": ln["served"]["reward"], "passed": ln["passed"]}
                              for ln in evals if ln.get("candidate")]}


def probe_series(gate: dict) -> tuple[str, str, list[tuple[float, float]]]:
    return ("the gate's probes (candidate)", "#2ca02c",
            [(p["step"], p["reward"]) for p in gate["probe_rewards"] if p["reward"] is not None])


def summary(gate: dict) -> str:
    steps = ", ".join(str(r["step"]) for r in gate["rollbacks"]) or "none"
    return (f"eval gate: {gate['evaluations']} evaluations, {gate['published']} published, "
            f"{len(gate['rollbacks'])} rolled back (at steps {steps})")
