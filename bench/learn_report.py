"""bench/learn.py's report: the printed curve lines, the summary, and the PNG plot (matplotlib,
the `bench` extra). Reads the result dict learn.py builds; runs nothing."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import learn_task as task


def point_line(mode: str, p: dict) -> str:
    g, s = p["greedy"], p["sampled"]
    return (f"[{mode}] step {p['step']:4d}  train {p['train_s'] / 60:5.1f} min  "
            f"greedy {g['reward']:+.2f} [{g['low']:+.2f}, {g['high']:+.2f}] "
            f"({g['correct']}/{g['n']} right)  sampled {s['reward']:+.2f} "
            f"[{s['low']:+.2f}, {s['high']:+.2f}] ({s['correct']}/{s['n']} right)  "
            f"eval {p['eval_s']:.0f} s")


def apart(first: dict, last: dict) -> str:
    if last["low"] > first["high"]:
        return "rose, intervals apart"
    if last["high"] < first["low"]:
        return "FELL, intervals apart"
    return "intervals overlap"


def summary_lines(result: dict) -> list[str]:
    load = result["machine"]["load_average_1m"]
    lines = [f"model {result['model_id']}, {len(result['held_out'])} held-out sums, "
             f"machine {result['machine']['cpus']} CPUs, 1-min load {load['before']:.1f} before, "
             f"{load['after']:.1f} after"]
    for mode, run in result["runs"].items():
        first, last = run["curve"][0], run["curve"][-1]
        st = run["step_time_s"] or {}
        lines += [
            f"[{mode}] greedy {first['greedy']['reward']:+.2f} -> {last['greedy']['reward']:+.2f} "
            f"({apart(first['greedy'], last['greedy'])}); sampled "
            f"{first['sampled']['reward']:+.2f} -> {last['sampled']['reward']:+.2f} "
            f"({apart(first['sampled'], last['sampled'])})",
            f"[{mode}] {run['steps']} optimizer steps ({run['skipped_batches']} batches skipped: "
            f"every advantage 0), {run['sessions']} sessions, "
            f"{run['failed_requests']} failed requests in {run['train_minutes']:.1f} training "
            f"min ({run['wall_minutes']:.1f} min with evaluations); step time median "
            f"{st.get('median', float('nan')):.2f} s (without rests "
            f"{st.get('median_without_rests', float('nan')):.2f} s), max "
            f"{st.get('max', float('nan')):.2f} s; server peak RSS {run['peak_rss_mb']:.0f} MB",
        ]
    base = result["runs"].get("reward")
    for mode, run in result["runs"].items():
        if base is None or mode == "reward":
            continue
        for kind in ("greedy", "sampled"):
            gain = run["curve"][-1][kind]["reward"] - run["curve"][0][kind]["reward"]
            ref = base["curve"][-1][kind]["reward"] - base["curve"][0][kind]["reward"]
            share = f"{gain / ref:.0%} of" if ref > 0 else "(reward mode gained nothing)"
            lines.append(f"[{mode}] {kind} gain {gain:+.2f}: {share} the reward mode's "
                         f"{ref:+.2f}")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = {"greedy": "tab:blue", "sampled": "tab:orange"}
    styles = {"reward": "-", "prm": "--", "prm-votes": ":", "opd": "-."}
    for ax, x_key, x_label in ((axes[0], "step", "optimizer steps"),
                               (axes[1], "train_s", "training minutes (evaluations excluded)")):
        for mode, run in result["runs"].items():
            xs = [p[x_key] / (60 if x_key == "train_s" else 1) for p in run["curve"]]
            for kind, colour in colours.items():
                ys = [p[kind]["reward"] for p in run["curve"]]
                lo = [p[kind]["low"] for p in run["curve"]]
                hi = [p[kind]["high"] for p in run["curve"]]
                ax.plot(xs, ys, styles.get(mode, "-"), color=colour, marker="o", ms=3,
                        label=f"{mode}: held-out {kind}")
                ax.fill_between(xs, lo, hi, color=colour, alpha=0.15)
            if x_key == "step" and run["train_steps"]:  # cheap between evaluations, but noisy
                xs, ys = zip(*[(s["step"], s["reward_mean"]) for s in run["train_steps"]
                               if s["reward_mean"] is not None])
                k = 10
                rolling = [mean(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
                ax.plot(xs, rolling, styles.get(mode, "-"), color="grey", lw=1,
                        label=f"{mode}: training batches' reward (rolling {k})")
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean held-out reward (95% interval)")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{result['model_id']}: {task.__doc__.splitlines()[0].split(': ', 1)[1]}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
