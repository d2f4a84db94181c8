"""Start-up refusals: how often `rlproxy serve` exits cleanly (code 2) when its learner refuses it.

A learner (`rlproxy serve --no-train`, answering the Tinker API) holds a run made at LoRA rank 8;
then a replica (`--trainer tinker --tinker-run rank8 --lora-rank 4`) is started N times and
refused each time ("trains ... at rank 8"). Every start should print the refusal and exit 2; a
start-up error that leaves the engine's MLX thread alive at exit ended some of them with SIGABRT
(-6) under load (CI saw one). `--load K` runs K busy loops alongside, as a loaded CI machine.
With `--other CHECKOUT` the starts alternate between this tree's code and that checkout's (its
folder on PYTHONPATH), so both see the same load: side by side.

    python bench/start_refusals.py [--starts 80] [--load 2] [--other /path/to/old/checkout]
                                   [--out bench/results/start_refusals.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, report  # noqa: E402
from rlproxy.ops.served import Served  # noqa: E402

KEY = "tml-bench"
HERE = Path(__file__).resolve().parent.parent


def serve(root: Path, name: str, flags: list[str], code: Path) -> Served:
    """`rlproxy serve --model tiny` run from CODE's checkout (its folder first on sys.path), its
    data dir ROOT/NAME and its log ROOT/NAME.log; not waited for."""
    return Served(root / name, "--no-fsync", *flags, cwd=code, python_path=(code, root),
                  env={"TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}, wait_s=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=80, help="refused starts per tree")
    ap.add_argument("--load", type=int, default=2, help="busy loops alongside")
    ap.add_argument("--other", type=Path, help="a second checkout, run side by side")
    ap.add_argument("--out", type=Path, default=Path("bench/results/start_refusals.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    trees = {"this": HERE, **({"other": args.other.resolve()} if args.other else {})}
    root = Path(tempfile.mkdtemp(prefix="rlproxy-bench-refusals-"))
    (root / "bench_reward.py").write_text("def reward(turn, next_state):\n    return 1.0\n")
    replica = ["--trainer", "tinker", "--tinker-run", "rank8", "--tinker-timeout-s", "10",
               "--no-judge", "--reward-function", "bench_reward:reward", "--no-prefix-cache"]
    codes = {name: collections.Counter() for name in trees}
    aborted_logs: dict[str, list[str]] = {name: [] for name in trees}
    busy = []
    learner = serve(root, "learner", ["--no-train", "--tinker-max-models", "16"], HERE)
    url = learner.url
    try:
        learner.wait_healthy(300)
        first = serve(root, "rank8", [*replica, "--tinker-url", url], HERE)
        first.wait_healthy(300)  # the run now exists at rank 8
        first.stop()
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.load)]
        for i in range(args.starts):
            for name, code in trees.items():
                refused = serve(root, f"{name}-{i}", [*replica, "--tinker-url", url,
                                                      "--lora-rank", "4"], code)
                rc = refused.proc.wait(timeout=300)
                codes[name][rc] += 1
                if rc != 2:
                    aborted_logs[name].append(refused.output()[-2000:])
                    print(f"{name} start {i}: exit {rc}", flush=True)
    finally:
        for p in busy:
            p.kill()
        learner.stop()
        shutil.rmtree(root, ignore_errors=True)
    result = {name: {"starts": args.starts, "exit_codes": {str(k): v for k, v in c.items()},
                     "not_2": args.starts - c[2], "logs_not_2": aborted_logs[name]}
              for name, c in codes.items()}
    result["environment"] = environment("tiny", load_before, settings={
        "starts": args.starts, "load": args.load,
        "trees": {name: str(code) for name, code in trees.items()}})
    lines = [f"{name} ({trees[name]}): {args.starts - c[2]} of {args.starts} refused starts did "
             f"not exit 2; exit codes {dict(c)}" for name, c in codes.items()]
    report(lines, result, args.out)


if __name__ == "__main__":
    main()
