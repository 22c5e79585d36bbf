"""Learning speed: success against wall time and env steps, asynchronous vs synchronous vs no correction.

What users buy is reaching a success rate sooner, so this is the product's headline benchmark.
From ONE warm start (the pixel task's demos + SFT, made once with `asyncvla collect` and
`asyncvla sft` and cached under OUT/learning/), three arms of
`asyncvla train configs/pixel_task.yaml policy.pretrained_path=SFT` get the same wall-clock budget
(learner.max_time_s):
    async    the system as shipped
    sync     --sync: rollout and training in series (today's synchronous VLA-RL loop)
    nocorr   asynchronous, algorithm.off_policy_correction=none (no V-trace: stale data as on-policy)
    parallel asynchronous with policy.action_head=parallel, from its own warm start (the head is
             part of the model, so SFT runs again with it; its time-0 point is that SFT policy)
Each arm checkpoints every few updates. Afterwards the published (EMA) weights of every
checkpoint — what the actors were running — are evaluated on the same fixed initial states,
sampled as actors sample, with Wilson 95 % intervals, and placed at the wall time of its save
(from the launcher's start: start-up counts) and at the env steps the learner had consumed.
The SFT policy itself is the point at time 0.

Prints a table (success at fixed times; time and env steps to the highest threshold every arm
reaches; async/sync time ratio, goal <= 0.6), writes OUT/learning.csv (one row per evaluation),
OUT/learning.png (success vs wall time and vs env steps, with interval bands) and the JSON.

    python -m tests.benchmarks.learning [--quick] [--out bench_results/learning.json]
    (--quick: 3-minute arms, 32 episodes; full: 15-minute arms, 64 episodes: ~75 min on 2 cores)
Each stage under OUT/learning/ (demos, each head's warm start, each arm) is reused only when it was
made with the same settings: the config file's bytes, the stage's command-line settings and, for an
arm, its budget and warm start (OUT/learning/made_with/STAGE.json records them). A finished arm is
then evaluated again but not retrained; anything else is made anew, as is everything with `fresh`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
import shutil
from pathlib import Path

from tests.benchmarks import workload
from tests.benchmarks.report import Figure, at_most, main
from tests.ports import run_port_overrides

CONFIG = workload.CONFIG
ARMS = {"async": [], "sync": ["--sync"], "nocorr": ["algorithm.off_policy_correction=none"],
        "parallel": ["policy.action_head=parallel"]}
# SFT settings of each head's warm start, beyond the config's. The parallel head learns to see
# later: cloning the oracle, its first action's token accuracy stays at the label marginal
# (~0.46) for ~300 steps where the autoregressive head's rises after 130-175, and the rest of an
# autoregressive chunk copies the first action. After the config's 300 steps its policy reached
# 17-19 % and RL did not improve it; after 600 it reaches 31 % [24, 40] (128 episodes).
WARM_START = {"autoregressive": [], "parallel": ["sft.steps=600"]}
THRESHOLDS = (0.9, 0.8, 0.7, 0.6, 0.5)
REPORT_AT_MIN = (0, 2, 5, 10, 15)
EVAL_SEED = 0
OUT_DIR = Path("bench_results")
MADE_WITH = "made_with"    # OUT/learning/made_with/STAGE.json: the settings a finished stage was made with


def run(quick: bool = False, out_dir: Path = OUT_DIR, arms=tuple(ARMS), fresh: bool = False) -> dict:
    """Make the stages not yet made with these settings under out_dir/learning (all with `fresh`), evaluate."""
    budget_s = 180.0 if quick else 900.0
    episodes = 32 if quick else 64
    save_every = 5
    work = out_dir / "learning"
    results = {"config": CONFIG, "budget_s": budget_s, "episodes": episodes, "eval_seed": EVAL_SEED,
               "save_interval": save_every, "arms": {}}
    if fresh:
        shutil.rmtree(work / MADE_WITH, ignore_errors=True)
    warm = {}                                      # action head -> (SFT policy, its success point)
    for arm in arms:
        head = _head(arm)
        if head not in warm:
            policy_dir = warm_start(work, head)
            warm[head] = policy_dir, evaluate_policy_dir(policy_dir, episodes)
        sft_policy, sft_point = warm[head]
        run_dir = work / arm
        settings = _settings(*ARMS[arm], f"budget_s={budget_s}", f"save_interval={save_every}",
                             warm_start=_settings(*_sft_args(head)))
        if _made_with(work, arm, settings):
            print(f"[learning] {arm}: reusing the finished run in {run_dir}", flush=True)
        else:
            print(f"[learning] {arm}: {budget_s:.0f} s of training", flush=True)
            train_arm(arm, sft_policy, work, budget_s, save_every)
            _stamp(work, arm, settings)
        curve = [dict(sft_point, wall_s=0.0, env_steps=0, step=0)]
        curve += evaluate_checkpoints(run_dir, episodes, min_gap_s=budget_s / 30)
        results["arms"][arm] = {"run_dir": str(run_dir), "curve": curve, "sft_policy": str(sft_policy)}
    results["summary"] = summarize(results)
    write_outputs(results, out_dir)
    return results


# ---------------------------------------------------------------------------------------- stages
def _head(arm: str) -> str:
    return next((a.split("=", 1)[1] for a in ARMS[arm] if a.startswith("policy.action_head=")), "autoregressive")


def warm_start(work: Path, head: str = "autoregressive") -> Path:
    """demos + SFT under `work` with the config's own settings (and action head), made once (cached)."""
    name = "sft_run" if head == "autoregressive" else f"sft_run_{head}"
    demos, policy = work / "demos", work / name / "sft" / "policy"
    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    sft = _sft_args(head)
    demos_settings, sft_settings = _settings(), _settings(*sft)     # as the stages start
    new_demos = not _made_with(work, "demos", demos_settings)
    if new_demos:
        shutil.rmtree(demos, ignore_errors=True)
        subprocess.run(cli + ["collect", CONFIG, "--out", str(demos)], check=True)
        _stamp(work, "demos", demos_settings)
    if new_demos or not _made_with(work, name, sft_settings):
        shutil.rmtree(work / name, ignore_errors=True)
        subprocess.run(cli + ["sft", CONFIG, f"sft.data={demos}", f"logging.output_dir={work}",
                              f"logging.experiment_name={name}", "logging.progress=false", *sft], check=True)
        _stamp(work, name, sft_settings)
    return policy


def _sft_args(head: str) -> list[str]:
    return [f"policy.action_head={head}", *WARM_START[head]]


def _settings(*args: str, **more) -> dict:
    """What a cached stage depends on: the config file's bytes and the stage's own settings."""
    return {"config_sha256": hashlib.sha256(Path(CONFIG).read_bytes()).hexdigest(), "args": list(args), **more}


def _made_with(work: Path, stage: str, settings: dict) -> bool:
    stamp = work / MADE_WITH / f"{stage}.json"
    return stamp.exists() and json.loads(stamp.read_text()) == settings


def _stamp(work: Path, stage: str, settings: dict) -> None:
    """Record that `stage` finished with `settings` (written last, so an interrupted stage has none)."""
    (work / MADE_WITH).mkdir(parents=True, exist_ok=True)
    (work / MADE_WITH / f"{stage}.json").write_text(json.dumps(settings, indent=1))


def train_arm(arm: str, sft_policy: Path, work: Path, budget_s: float, save_every: int) -> None:
    """One `asyncvla train` run of `budget_s` seconds of training into work/arm (anew)."""
    run_dir = work / arm
    (work / MADE_WITH / f"{arm}.json").unlink(missing_ok=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    flags = [a for a in ARMS[arm] if a.startswith("--")]
    overrides = [a for a in ARMS[arm] if not a.startswith("--")]
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", CONFIG, *overrides, *run_port_overrides(),
           f"policy.pretrained_path={sft_policy}", f"logging.output_dir={work}", f"logging.experiment_name={arm}",
           "logging.progress=false", "learner.max_steps=100000", f"learner.max_time_s={budget_s}",
           f"checkpoint.save_interval={save_every}", "checkpoint.keep_last=100000", "eval.eval_interval=0",
           *flags]          # flags last: argparse takes no positional override after one
    subprocess.run(cmd, check=True, timeout=budget_s + 300, stdout=subprocess.DEVNULL)


def evaluate_checkpoints(run_dir: Path, episodes: int, min_gap_s: float) -> list[dict]:
    """Evaluate checkpoints at least min_gap_s of wall time apart (and the last one). Wall time
    counts from the launcher's start, when it wrote the run's launch_config.yaml."""
    from asyncvla.learner import checkpoint
    from asyncvla.learner.export import load_checkpoint

    started = (run_dir / "launch_config.yaml").stat().st_mtime
    tags = checkpoint._complete_tags(run_dir / checkpoint.CHECKPOINTS)          # noqa: SLF001
    chosen, last_t = [], -float("inf")
    for i, tag in enumerate(tags):
        t = checkpoint.read_marker(tag)["saved_at"]
        if t - last_t >= min_gap_s or i == len(tags) - 1:
            chosen.append(tag)
            last_t = t
    points = []
    for tag in chosen:
        marker = checkpoint.read_marker(tag)
        state = checkpoint.read_client_state(tag)
        policy, cfg, _ = load_checkpoint(tag, weights="ema")
        point = evaluate(policy, cfg, episodes)
        point.update(wall_s=marker["saved_at"] - started, env_steps=int(state["env_steps"]),
                     step=int(state["step"]))
        points.append(point)
    return points


def evaluate_policy_dir(policy_dir: Path, episodes: int) -> dict:
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import VLAPolicy
    return evaluate(VLAPolicy.from_pretrained(str(policy_dir)), load_config(CONFIG), episodes)


def evaluate(policy, cfg, episodes: int) -> dict:
    from asyncvla.actors.evaluate import evaluate_policy
    s = evaluate_policy(policy, cfg.env, policy.cfg, episodes, greedy=False, seed=EVAL_SEED)
    return {"success": s["success_rate"], "ci_low": s["success_ci95"][0], "ci_high": s["success_ci95"][1]}


# ---------------------------------------------------------------------------------------- report
def at_time(curve: list[dict], t: float) -> dict | None:
    """The last evaluation at or before wall time t (None when t is past the run's end)."""
    if t > curve[-1]["wall_s"] + 60:
        return None
    before = [p for p in curve if p["wall_s"] <= t]
    return before[-1] if before else curve[0]


def first_reaching(curve: list[dict], threshold: float) -> dict | None:
    return next((p for p in curve if p["success"] >= threshold), None)


def summarize(results: dict) -> dict:
    arms = results["arms"]
    common = next((th for th in THRESHOLDS if all(first_reaching(a["curve"], th) for a in arms.values())), None)
    out = {"threshold": common, "reach": {}, "at_minutes": {}}
    for name, a in arms.items():
        hit = first_reaching(a["curve"], common) if common is not None else None
        out["reach"][name] = None if hit is None else {"wall_s": hit["wall_s"], "env_steps": hit["env_steps"]}
        out["at_minutes"][name] = {m: at_time(a["curve"], 60 * m) for m in REPORT_AT_MIN}
    r = out["reach"]
    if r.get("async") and r.get("sync"):
        out["time_ratio_async_sync"] = r["async"]["wall_s"] / max(r["sync"]["wall_s"], 1e-9)
    return out


def write_outputs(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "learning.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "wall_s", "env_steps", "step", "success", "ci_low", "ci_high"])
        for name, a in results["arms"].items():
            for p in a["curve"]:
                w.writerow([name, round(p["wall_s"], 1), p["env_steps"], p["step"], p["success"],
                            round(p["ci_low"], 4), round(p["ci_high"], 4)])
    plot(results, out_dir / "learning.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, a in results["arms"].items():
        c = a["curve"]
        for ax, key, scale in ((axes[0], "wall_s", 60.0), (axes[1], "env_steps", 1000.0)):
            x = [p[key] / scale for p in c]
            ax.plot(x, [p["success"] for p in c], marker="o", ms=3, label=name)
            ax.fill_between(x, [p["ci_low"] for p in c], [p["ci_high"] for p in c], alpha=0.2)
    axes[0].set_xlabel("wall time (min)")
    axes[1].set_xlabel("env steps (thousands)")
    axes[0].set_ylabel(f"success ({results['episodes']} fixed episodes, sampled; 95% CI)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    axes[0].legend()
    fig.suptitle("PixelReach-v0 from SFT warm starts: async vs sync vs no off-policy correction vs parallel head")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(results: dict) -> list[Figure]:
    s = results["summary"]
    figs = []
    for name, a in results["arms"].items():
        for m, p in s["at_minutes"][name].items():
            if p is not None and 60 * m <= results["budget_s"]:
                figs.append(Figure("learning", f"{name}: success at {m} min", p["success"], "%",
                                   note=f"95% CI [{100 * p['ci_low']:.0f}, {100 * p['ci_high']:.0f}] %, "
                                        f"{p['env_steps']} env steps"))
    th = s["threshold"]
    for name, r in s["reach"].items():
        figs.append(Figure("learning", f"{name}: time to {th:.0%} success" if th else f"{name}: time to threshold",
                           None if r is None else r["wall_s"], "s",
                           note="no threshold all arms reach" if r is None else f"{r['env_steps']} env steps"))
    ratio = s.get("time_ratio_async_sync")
    figs.append(Figure("learning", "async / sync time to threshold", ratio, "x", "<= 0.6", at_most(ratio, 0.6),
                       note="wrote learning.csv and learning.png"))
    return figs


if __name__ == "__main__":
    main(sys.modules[__name__])
