"""tinker-cookbook's own recipes, unmodified, against a fresh `rlproxy serve`: an ecosystem check.

    python bench/cookbook.py [--model smollm2-135m-instruct] [--sl-steps 10] [--rl-steps 10]
                             [--rl-groups 8] [--venv ~/.cache/rlproxy-cookbook-venv]
                             [--out bench/results/cookbook.json]

It makes the client venv if it is missing (tinker-cookbook pins its own transformers and needs
torch, so it lives apart from rlproxy's environment), starts `rlproxy serve --model MODEL
--no-train --no-judge` on a free port, and runs, as a user would, with TINKER_BASE_URL pointing
at it and the hub offline:

- `tinker_cookbook.recipes.chat_sl.train` on the cookbook's bundled
  example_data/conversations.jsonl (SL, cross_entropy), SL_STEPS steps;
- `tinker_cookbook.recipes.math_rl.train env=arithmetic` (RL, importance_sampling: sample a
  group per problem right after save_weights_and_get_sampling_client, score, train), RL_STEPS
  steps of RL_GROUPS groups of 4.

The offline set-up is the one the README's "Running tinker-cookbook recipes" gives: the recipe's
model_name is the server's hub-style served name (the default model answers to
HuggingFaceTB/SmolLM2-135M-Instruct too), and a folder of that name in the recipes' working
directory links to the server's tokenizer directory (/healthz `model_source.path`), which the
cookbook's get_tokenizer opens as a local path. The renderer is `qwen3_instruct`: plain ChatML,
token for token what SmolLM2's and the embedded models' chat templates write.

It prints each recipe's metrics per step (from the recipe's own metrics.jsonl) and the server's
Tinker counters and sampling failures (WARNING/ERROR lines naming asample), and writes it all as
JSON. Not part of the test suite; on 2 busy CPU cores a SmolLM2 RL step takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, report  # noqa: E402
from rlproxy.ops.served import Served  # noqa: E402

# The newest release that installs on Python 3.11 (0.6 needs tml-renderers >= 0.4.1, which
# needs 3.12); [math-rl] brings the graders math_rl imports even for env=arithmetic.
COOKBOOK = "tinker-cookbook[math-rl]==0.5.8"
DEFAULT_VENV = Path.home() / ".cache" / "rlproxy-cookbook-venv"
RENDERER = "qwen3_instruct"
KEY = "tml-local"  # the SDK refuses keys not starting with tml-; rlproxy checks none by default
SL_METRICS = ("train_mean_nll", "learning_rate", "num_sequences", "time/step")
RL_METRICS = ("env/all/format", "env/all/correct", "env/all/reward/total",
              "env/all/total_episodes", "time/sampling", "time/train_step", "time/total")


def client_venv(venv: Path, python: str) -> Path:
    """VENV's python with COOKBOOK installed (the venv made, or the package installed, first)."""
    py = venv / "bin" / "python"
    wanted = COOKBOOK.split("==")[1]
    check = ("from importlib.metadata import version; import sympy, tinker_cookbook; "
             f"assert version('tinker-cookbook') == {wanted!r}")
    if py.exists() and subprocess.run([py, "-c", check], capture_output=True).returncode == 0:
        return py
    if not py.exists():
        print(f"making the client venv {venv} ({python} -m venv)", flush=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    print(f"installing {COOKBOOK} into {venv} (with torch: minutes, once)", flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", COOKBOOK], check=True)
    return py


def served_name(health: dict) -> str:
    """The name the recipes give as model_name: a hub-style 'org/model' one when the server
    answers to one (the cookbook's model tables key on those), else its first."""
    names = health["served_model_names"]
    return next((n for n in names if "/" in n), names[0])


def link_tokenizer(work: Path, name: str, tokenizer_dir: str) -> None:
    """WORK/NAME -> the server's tokenizer directory: the cookbook's get_tokenizer(NAME) opens a
    local directory of that name before it would ask the hub."""
    link = work / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tokenizer_dir, target_is_directory=True)


def run_recipe(py: Path, module: str, overrides: list[str], work: Path, env: dict,
               log: Path, timeout_s: float) -> dict:
    """`python -m MODULE OVERRIDES...` in WORK; its metrics.jsonl, one dict per step."""
    command = [str(py), "-m", module, *overrides]
    print("$ " + " ".join(command), flush=True)
    tic = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    wall = time.monotonic() - tic
    if proc.returncode != 0:
        raise SystemExit(f"{module} exited with {proc.returncode} after {wall:.0f} s; the end of "
                         f"its log ({log}):\n{log.read_text(errors='replace')[-6000:]}")
    log_path = next(o.split("=", 1)[1] for o in overrides if o.startswith("log_path="))
    steps = [json.loads(line) for line in (Path(log_path) / "metrics.jsonl").read_text()
             .splitlines() if line.strip()]
    return {"command": command, "wall_s": round(wall, 1), "steps": steps}


def table(title: str, steps: list[dict], keys: tuple[str, ...]) -> list[str]:
    shown = [k for k in keys if any(k in s for s in steps)]
    lines = [title, "  step  " + "  ".join(f"{k:>22}" for k in shown)]
    for i, s in enumerate(steps):
        cells = [f"{s[k]:>22.4g}" if isinstance(s.get(k), (int, float)) else f"{'-':>22}"
                 for k in shown]
        lines.append(f"  {s.get('step', s.get('progress/batch', i)):>4}  " + "  ".join(cells))
    return lines


def first_last(steps: list[dict], key: str) -> str:
    values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
    return f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sl-steps", type=int, default=10)
    p.add_argument("--sl-batch", type=int, default=8)
    p.add_argument("--rl-steps", type=int, default=10)
    p.add_argument("--rl-groups", type=int, default=8, help="groups_per_batch (recipe: 100)")
    p.add_argument("--rl-group-size", type=int, default=4)
    p.add_argument("--renderer", default=RENDERER)
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--python", default=sys.executable, help="interpreter the venv is made with")
    p.add_argument("--timeout-s", type=float, default=7200, help="per recipe")
    p.add_argument("--keep", type=Path, help="work here (kept) instead of a temp dir")
    p.add_argument("--out", type=Path, default=Path("bench/results/cookbook.json"))
    a = p.parse_args()

    load_before = os.getloadavg()[0]
    py = client_venv(a.venv, a.python)
    package = subprocess.run([py, "-c", "import os, tinker_cookbook; "
                              "print(os.path.dirname(tinker_cookbook.__file__))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    conversations = Path(package) / "example_data" / "conversations.jsonl"
    root = a.keep or Path(tempfile.mkdtemp(prefix="rlproxy-cookbook-"))
    root.mkdir(parents=True, exist_ok=True)
    work = root / "work"
    work.mkdir(exist_ok=True)
    with Served(root / "data", "--no-train", "--no-judge", model=a.model, log=root / "server.log",
                env={"TINKER_TELEMETRY": "0"}, wait_s=600) as server:
        health = server.health()
        name, tokenizer_dir = served_name(health), health["model_source"]["path"]
        link_tokenizer(work, name, tokenizer_dir)
        env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEY,
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
               "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        common = [f"model_name={name}", f"renderer_name={a.renderer}",
                  "behavior_if_log_dir_exists=delete"]
        sl = run_recipe(py, "tinker_cookbook.recipes.chat_sl.train", [
            *common, f"dataset={conversations}", f"batch_size={a.sl_batch}",
            f"max_steps={a.sl_steps}", f"log_path={root / 'chat_sl'}"],
            work, env, root / "chat_sl.log", a.timeout_s)
        rl = run_recipe(py, "tinker_cookbook.recipes.math_rl.train", [
            *common, "env=arithmetic", f"groups_per_batch={a.rl_groups}",
            f"group_size={a.rl_group_size}", f"max_steps={a.rl_steps}",
            f"log_path={root / 'math_rl'}"],
            work, env, root / "math_rl.log", a.timeout_s)
        tinker = server.health()["tinker"]
        failures = [line for line in server.output().splitlines()
                    if "asample" in line and (" WARNING " in line or " ERROR " in line)]

    lines = [*table(f"chat_sl on {name} ({len(sl['steps'])} steps, {sl['wall_s']:.0f} s)",
                    sl["steps"], SL_METRICS),
             *table(f"math_rl env=arithmetic on {name} ({len(rl['steps'])} steps, "
                    f"{rl['wall_s']:.0f} s)", rl["steps"], RL_METRICS),
             f"chat_sl train_mean_nll {first_last(sl['steps'], 'train_mean_nll')}",
             f"math_rl format {first_last(rl['steps'], 'env/all/format')}, correct "
             f"{first_last(rl['steps'], 'env/all/correct')}, reward "
             f"{first_last(rl['steps'], 'env/all/reward/total')}",
             f"server: {tinker['forward_backward']} forward_backward, {tinker['optim_steps']} "
             f"optim_step, {tinker['samplers']} sampling sessions, {len(failures)} sampling "
             "failures logged",
             f"work dir {root}"]
    result = {**environment(a.model, load_before, health["model"], settings={
        "served_name": name, "renderer": a.renderer, "cookbook": COOKBOOK,
        "sl_steps": a.sl_steps, "sl_batch": a.sl_batch, "rl_steps": a.rl_steps,
        "rl_groups": a.rl_groups, "rl_group_size": a.rl_group_size}),
        "chat_sl": sl, "math_rl": rl, "server_tinker": tinker, "sampling_failures": failures}
    report(lines, result, a.out)
    if failures or len(rl["steps"]) < a.rl_steps or len(sl["steps"]) < a.sl_steps:
        raise SystemExit("a recipe fell short or sampling failed: see above")


if __name__ == "__main__":
    main()
