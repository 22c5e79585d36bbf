"""One policy on several tasks, measured: configs/multitask.yaml's pipeline per seed, then each task
evaluated with its training sentence, its held-out phrasing and another task's sentence.

Per seed (env.seed, actor.seed and learner.seed the seed):
    1. pipeline  `asyncvla pipeline configs/multitask.yaml`: scripted demos of every task, SFT on all
                 of them, asynchronous RL on the mix (learner.max_time_s), and the summary: SFT's and
                 RL's success per task and pooled, on --episodes fixed episodes per task
    2. language  `asyncvla eval RUN --instruction-set eval` (the held-out phrasings) and
                 `--instruction-set swapped` (each task told the next task's sentence: the control)
    3. curves    tensorboard's env/success/<task> of the RL run (the training episodes' success)
Evaluations run after training, so that they never compete with it for cores. 128 episodes per
task and 95 % Wilson intervals by default. Every stage is cached under OUT/multitask/ (delete a
run folder to redo it). Writes OUT/multitask_learning.json, .md (the tables and the checks the
issue asks for) and .png (each task's training success vs wall time, per seed).

    python -m tests.benchmarks.multitask_learning --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
from tests.support.ports import run_port_overrides

CONFIG = REPO / "configs" / "multitask.yaml"


def run(seeds: list[int], out: Path, episodes: int, overrides: tuple[str, ...] = ()) -> dict:
    work = out / "multitask"
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    results = {"config": str(CONFIG.relative_to(REPO)), "episodes": episodes, "overrides": list(overrides),
               "commit": _commit(), "cores": os.cpu_count(), "seeds": {}}
    for seed in seeds:
        name = f"seed{seed}"
        run_dir = work / name
        common = [f"env.seed={seed}", f"actor.seed={seed}", f"learner.seed={seed}", f"logging.output_dir={work}",
                  f"logging.experiment_name={name}", f"sft.eval_episodes={episodes}", f"eval.num_episodes={episodes}",
                  "logging.progress=false", *overrides]
        if not (run_dir / "summary.json").exists():
            _run(cli + ["pipeline", str(CONFIG), *common, *run_port_overrides()], work / f"{name}.log")
        summary = json.loads((run_dir / "summary.json").read_text())
        words = {}
        for instruction_set in ("eval", "swapped"):
            path = run_dir / f"eval_{instruction_set}.json"
            if not path.exists():
                _run(cli + ["eval", str(run_dir), "--weights", "ema", "--sample", "--episodes", str(episodes),
                            "--instruction-set", instruction_set, "--out", str(path)],
                     work / f"{name}_eval_{instruction_set}.log")
            words[instruction_set] = _figures(json.loads(path.read_text()))
        results["seeds"][str(seed)] = {"sft": summary["sft"], "rl": summary["rl"], **words,
                                       "curves": curves(run_dir)}
        write_outputs(results, out)               # (after every seed: a long run loses nothing)
    return results


def _figures(summary: dict) -> dict:
    out = {"success_rate": summary["success_rate"], "ci95": summary["success_ci95"]}
    out["tasks"] = {k: {"success_rate": t["success_rate"], "ci95": t["success_ci95"]}
                    for k, t in summary.get("tasks", {}).items()}
    return out


def curves(run_dir: Path) -> dict:
    """Each task's training success (tensorboard env/success/<task>) by wall time of RL (s)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("env/success/"):
            events = acc.Scalars(tag)
            t0 = events[0].wall_time if events else 0.0
            out[tag.split("/", 2)[2]] = [(e.wall_time - t0, e.step, e.value) for e in events]
    return out


def checks(r: dict) -> dict:
    """The acceptance checks of one seed: RL's pooled lower bound above SFT's upper; no task's RL
    figure below its SFT interval; the swapped instruction's success below the right one's."""
    sft, rl, swapped = r["sft"], r["rl"], r["swapped"]
    return {"mean_above": rl["ci95"][0] > sft["ci95"][1],
            "no_task_below": all(rl["tasks"][k]["success_rate"] >= sft["tasks"][k]["ci95"][0]
                                 for k in rl["tasks"]),
            "swapped_falls": swapped["ci95"][1] < rl["ci95"][0]}


def _pct(f: dict) -> str:
    return f"{100 * f['success_rate']:.1f} % [{100 * f['ci95'][0]:.1f}, {100 * f['ci95'][1]:.1f}]"


def markdown(results: dict) -> str:
    lines = [f"configs/multitask.yaml, {results['episodes']} fixed episodes per task, sampled as the actors sample, "
             f"95 % Wilson intervals (pooled: the tasks' mean), commit {results['commit']}", "",
             "| seed | task | SFT | after RL | held-out phrasing | another task's sentence |",
             "|---|---|---|---|---|---|"]
    for seed, r in results["seeds"].items():
        for k in r["rl"]["tasks"]:
            lines.append(f"| {seed} | {k} | {_pct(r['sft']['tasks'][k])} | {_pct(r['rl']['tasks'][k])} | "
                         f"{_pct(r['eval']['tasks'][k])} | {_pct(r['swapped']['tasks'][k])} |")
        lines.append(f"| {seed} | **mean** | {_pct(r['sft'])} | {_pct(r['rl'])} | {_pct(r['eval'])} | "
                     f"{_pct(r['swapped'])} |")
    lines += ["", "| seed | RL's mean: lower bound above SFT's upper | no task below its SFT interval | "
              "swapped sentences: upper bound below RL's lower |", "|---|---|---|---|"]
    for seed, r in results["seeds"].items():
        c = checks(r)
        lines.append(f"| {seed} | " + " | ".join("yes" if c[k] else "no" for k in
                                                 ("mean_above", "no_task_below", "swapped_falls")) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = results["seeds"]
    tasks = sorted({k for r in seeds.values() for k in r["curves"]})
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.5 * max(1, len(tasks)), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for seed, r in seeds.items():
            pts = r["curves"].get(task, [])
            ax.plot([p[0] / 60 for p in pts], [100 * p[2] for p in pts], alpha=0.8, label=f"seed {seed}")
            lo, hi = r["sft"]["tasks"][task]["ci95"]
            ax.axhspan(100 * lo, 100 * hi, color="grey", alpha=0.08)
        ax.set_title(f"{task} (grey: SFT's intervals)")
        ax.set_xlabel("wall time of RL (min)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training episodes' success (%)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> None:
    (out / "multitask_learning.json").write_text(json.dumps(results, indent=2))
    (out / "multitask_learning.md").write_text(markdown(results))
    plot(results, out / "multitask_learning.png")


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd[:6]), "...", flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--episodes", type=int, default=128, help="fixed evaluation episodes per task")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every stage (e.g. a shorter RL budget)")
    args = ap.parse_args()
    results = run([int(s) for s in args.seeds.split(",")], args.out, args.episodes, tuple(args.overrides))
    print(markdown(results))


if __name__ == "__main__":
    main()
