"""Bring your own VLA, measured: a tiny SmolVLA trained with LeRobot, then asynchronous RL in asyncvla.

Per task (--task pixel: configs/pixel_task.yaml; pushcube: configs/smolvla.yaml) and seed:
    1. demos     `asyncvla collect CONFIG --format lerobot` (once per task): a LeRobot dataset
    2. LeRobot   tests/interop/smolvla_train.py in `make interop-env`'s environment: LeRobot's
                 SmolVLAPolicy, processors, optimizer and scheduler presets, trained on the demos
                 (a tiny random-init SmolVLM as its backbone, trained along: 16 image tokens, the
                 patch positions asyncvla's fixed sine-cosine pattern), saved as LeRobot
                 saves a policy: the "user's own VLA"
    3. RL        `asyncvla train CONFIG policy.pretrained_path=THAT_DIR` (env.seed, actor.seed and learner.seed
                 the seed), a checkpoint every --save-interval updates, no evaluator beside it
    4. measured  after training (so that evaluation never competes with it for cores), on the same
                 fixed initial states (seed 0), sampled as the actors sample, 95 % Wilson intervals:
                 the loaded policy (RUN/policy_init), each checkpoint's published (EMA) weights at
                 its wall time (the curve), and the last checkpoint exported with
                 `asyncvla export --format lerobot --weights ema` (the weights the curve evaluates) and
                 loaded again from that LeRobot directory.
Every stage is cached under OUT/smolvla_learning/TASK/ (delete a folder to redo it). Writes
OUT/smolvla_learning_TASK.json, .md (the table) and .png (success vs wall time, per seed, with
intervals). Pixel task: ~30 min per seed on 2 cores.

    python -m tests.benchmarks.smolvla_learning --task pixel --seeds 0,1,2
    python -m tests.benchmarks.smolvla_learning --task pixel --seeds 0 --variant lora policy.is_lora=true ...

A variant (--variant NAME, then RL overrides after the task's own) keeps the demos and the LeRobot
policies and puts its RL runs and outputs under its own name (TASK_NAME): a change to the RL recipe
is measured from the same starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.learning import EVAL_SEED, evaluate, evaluate_checkpoints
from tests.support.paths import REPO
from tests.support.ports import run_port_overrides

INTEROP_PY = REPO / ".venv-interop" / "bin" / "python"
TASKS = {
    # config, demos, LeRobot training (tests/interop/smolvla_train.py flags), RL overrides
    "pixel": dict(config="configs/pixel_task.yaml", demos=200, sft=["--steps", "1500", "--batch-size", "64",
                                                                     "--vlm-patch-size", "8", "--vlm-position-init", "sincos"],
                  # the expert trains (the VLM frozen, LeRobot's default) beside a CNN critic
                  # (pixel_task.yaml's policy.value_encoder) fit for 50 updates before the policy moves
                  rl=["learner.max_steps=1200", "policy.flow.train_expert_only=true",
                      "learner.critic_warmup_steps=50", "learner.lr_decay_style=linear"]),
    "pushcube": dict(config="configs/smolvla.yaml", demos=300, sft=["--steps", "3000", "--batch-size", "64",
                                                                    "--vlm-patch-size", "8"],
                     rl=["learner.max_steps=200", "learner.max_time_s=1500"]),
}


def run(task: str, seeds: list[int], out: Path, episodes: int, save_interval: int,
        variant: str | None = None, rl_overrides: tuple[str, ...] = ()) -> dict:
    t = TASKS[task]
    work = out / "smolvla_learning" / task
    runs = work if variant is None else out / "smolvla_learning" / f"{task}_{variant}"
    runs.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    demos = work / "demos"
    if not (demos / "meta" / "info.json").exists():
        shutil.rmtree(demos, ignore_errors=True)
        _run(cli + ["collect", t["config"], "--episodes", str(t["demos"]), "--format", "lerobot", "--out", str(demos)])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    results = {"task": task if variant is None else f"{task}_{variant}", "config": t["config"], "episodes": episodes,
               "eval_seed": EVAL_SEED, "commit": commit, "cores": os.cpu_count(),
               "rl_overrides": [*t["rl"], *rl_overrides], "seeds": {}}
    for seed in seeds:
        lerobot_dir = work / f"lerobot_seed{seed}"
        if not (lerobot_dir / "policy" / "model.safetensors").exists():
            _run([str(INTEROP_PY), str(REPO / "tests" / "interop" / "smolvla_train.py"), str(demos), str(lerobot_dir),
                  *t["sft"], "--train-vlm", "--seed", str(seed)], log=work / f"lerobot_seed{seed}.log")
        run_dir = runs / f"rl_seed{seed}"
        if not (run_dir / "rl_done.json").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            _run(cli + ["train", t["config"], *t["rl"], *rl_overrides, f"policy.pretrained_path={lerobot_dir / 'policy'}",
                        f"env.seed={seed}", f"actor.seed={seed}", f"learner.seed={seed}", f"logging.output_dir={runs}",
                        f"logging.experiment_name=rl_seed{seed}", "logging.progress=false", "eval.eval_interval=0",
                        f"checkpoint.save_interval={save_interval}", "checkpoint.keep_last=1000",
                        *run_port_overrides()], log=runs / f"rl_seed{seed}.log")
            (run_dir / "rl_done.json").write_text("{}")
        exported = runs / f"exported_seed{seed}"
        if not (exported / "model.safetensors").exists():
            shutil.rmtree(exported, ignore_errors=True)
            _run(cli + ["export", str(run_dir), "--out", str(exported), "--format", "lerobot", "--weights", "ema"])
        results["seeds"][str(seed)] = measure(t["config"], lerobot_dir / "policy", run_dir, exported, episodes)
        print(json.dumps({seed: _brief(results["seeds"][str(seed)])}), flush=True)
        write_outputs(results, out)                 # (after every seed: a long run loses nothing)
    return results


def measure(config: str, loaded: Path, run_dir: Path, exported: Path, episodes: int) -> dict:
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import build_policy, load_policy
    cfg = load_config(config, [f"policy.pretrained_path={exported}"])
    curve = evaluate_checkpoints(run_dir, episodes, min_gap_s=0.0)
    return {
        "loaded": evaluate(load_policy(run_dir / "policy_init"), cfg, episodes),
        "curve": curve,
        "rl": curve[-1],
        "exported": evaluate(build_policy(cfg.policy), cfg, episodes),
        "lerobot_dir": str(loaded),
    }


def _brief(r: dict) -> dict:
    return {k: round(r[k]["success"], 3) for k in ("loaded", "rl", "exported")}


def write_outputs(results: dict, out: Path) -> None:
    tag = f"smolvla_learning_{results['task']}"
    (out / f"{tag}.json").write_text(json.dumps(results, indent=2))
    (out / f"{tag}.md").write_text(markdown(results))
    plot(results, out / f"{tag}.png")


def _pct(p: dict) -> str:
    return f"{100 * p['success']:.1f} % [{100 * p['ci_low']:.1f}, {100 * p['ci_high']:.1f}]"


def markdown(results: dict) -> str:
    lines = [f"{results['task']}: {results['episodes']} fixed episodes (seed {results['eval_seed']}), sampled as the "
             "actors sample, 95 % Wilson intervals", "",
             "| seed | loaded (LeRobot-trained) | after RL | updates | RL wall time | RL's lower bound above the loaded upper? "
             "| exported to LeRobot, reloaded | same as RL's (intervals overlap)? |",
             "|---|---|---|---|---|---|---|---|"]
    for seed, r in results["seeds"].items():
        above = r["rl"]["ci_low"] > r["loaded"]["ci_high"]
        same = r["exported"]["ci_low"] <= r["rl"]["ci_high"] and r["rl"]["ci_low"] <= r["exported"]["ci_high"]
        lines.append(f"| {seed} | {_pct(r['loaded'])} | {_pct(r['rl'])} | {r['rl']['step']} | "
                     f"{r['rl']['wall_s'] / 60:.1f} min | {'yes' if above else 'no'} | {_pct(r['exported'])} | "
                     f"{'yes' if same else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, r in results["seeds"].items():
        xs = [0.0] + [p["wall_s"] / 60 for p in r["curve"]]
        pts = [r["loaded"]] + r["curve"]
        line, = ax.plot(xs, [100 * p["success"] for p in pts], marker="o", label=f"seed {seed}")
        ax.fill_between(xs, [100 * p["ci_low"] for p in pts], [100 * p["ci_high"] for p in pts],
                        color=line.get_color(), alpha=0.15)
    ax.set_xlabel("wall time of RL (min, start-up included; 0 = the loaded LeRobot policy)")
    ax.set_ylabel("success (%)")
    ax.set_title(f"SmolVLA trained with LeRobot, then async RL: {results['task']}")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run(cmd: list[str], log: Path | None = None) -> None:
    print("+", " ".join(cmd[:6]), "...", flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="pixel")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--save-interval", type=int, default=100, help="updates between the curve's checkpoints")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    ap.add_argument("--variant", help="a name for RL runs with the overrides that follow (see above)")
    ap.add_argument("rl_overrides", nargs="*", help="key=value overrides of the RL runs, after the task's own")
    args = ap.parse_args()
    if args.rl_overrides and not args.variant:
        ap.error("RL overrides change the recipe: name them with --variant NAME, so their runs do not mix with the task's")
    if not INTEROP_PY.exists():
        sys.exit(f"{INTEROP_PY} is missing: `make interop-env` builds LeRobot's environment")
    results = run(args.task, [int(s) for s in args.seeds.split(",")], args.out, args.episodes, args.save_interval,
                  args.variant, tuple(args.rl_overrides))
    print(markdown(results))


if __name__ == "__main__":
    main()
