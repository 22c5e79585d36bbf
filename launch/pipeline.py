"""`asyncvla pipeline CONFIG [overrides]`: demonstrations, then SFT, then asynchronous RL.

The path users take, as one command. Every stage keeps its result in the run directory RUN
(logging.output_dir/logging.experiment_name), so a second call resumes rather than repeats:
    1. RUN/demos/        `asyncvla collect` (collect.num_episodes)         skipped when present
    2. RUN/sft/policy/   `asyncvla sft` on them (a cut-off SFT continues
                         from its latest checkpoint)                       skipped when present
    3. RUN/              `asyncvla train` from that policy (budget:       resumed from RUN's latest
                         learner.max_steps / max_env_steps / max_time_s)   complete checkpoint; skipped
                                                                          once it ended by its budget
    4. RUN/summary.json  success after SFT and after RL on the same fixed initial states, sampled
                         as the actors sample, with 95% Wilson intervals
When policy.pretrained_path holds a policy trained elsewhere (a LeRobot SmolVLA directory), there
are no demonstrations and no SFT: RL starts from it, and the summary sets the loaded policy (the
run's policy_init/) against RL's.
Each stage runs in its own processes; extra flags (--sync, --num-actors) go to `asyncvla train`.

Stopping: each stage runs in a session of its own, and Ctrl-C (or SIGTERM) to the pipeline is
passed on to it once per press, so the stage stops as it would on its own Ctrl-C (RL: final
checkpoint, then exit 130; a second press kills it) and is never killed from here. RL counts as
done only when `asyncvla train` exits 0, which it does only when the run ended by its budget.
Exit codes: 0 done (the summary printed); 130 / 143 interrupted by SIGINT / SIGTERM, after one line
saying where ("the same command continues"); 1 a stage failed; 2 a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from asyncvla.common.signals import die_with_parent

RL_FINISHED = "rl_finished.json"      # written once `asyncvla train` has ended by its budget
SUMMARY = "summary.json"


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="demonstrations -> SFT -> asynchronous RL, each stage cached",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every stage")
    p.add_argument("--sync", action="store_true", help="RL with rollout and training serialised")
    p.add_argument("--num-actors", type=int, help="local actor processes of the RL stage")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.common.config import ConfigError, load_config, parse_overrides
    from asyncvla.common.rundir import run_dir as run_dir_of_config

    overrides = parse_overrides(args.overrides)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"asyncvla pipeline: config error: {e}", file=sys.stderr)
        return 2
    from asyncvla.common import trackers
    from asyncvla.launch import preflight
    found = trackers.problems(cfg) + preflight.env_problems(cfg)   # (before minutes of demos and SFT)
    for line in found:
        print(f"asyncvla pipeline: cannot start: {line}", file=sys.stderr)
    if found:
        return 2
    run_dir = run_dir_of_config(cfg)
    demos, policy = run_dir / "demos", run_dir / "sft" / "policy"
    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    from asyncvla.common.policy import starts_trained
    if starts_trained(cfg.policy.pretrained_path):
        _say(f"1-2/3 demonstrations and SFT: none, the policy is trained ({cfg.policy.pretrained_path})")
        return _rl_and_summary(args, cfg, run_dir, cli, [*overrides])

    if (demos / "trajectory.h5").exists():
        _say(f"1/3 demonstrations: cached in {demos}")
    else:
        _say(f"1/3 demonstrations: collecting {cfg.collect.num_episodes} episodes into {demos}")
        if (code := _stage("demonstrations", cli + ["collect", args.config, *overrides, "--out", str(demos)])):
            return code
    if (policy / "policy.json").exists():
        _say(f"2/3 SFT: cached in {policy}")
    else:
        _say(f"2/3 SFT: {cfg.sft.steps} steps on {demos}")
        if (code := _stage("SFT", cli + ["sft", args.config, *overrides, f"sft.data={demos}"])):
            return code
    return _rl_and_summary(args, cfg, run_dir, cli, [*overrides, f"policy.pretrained_path={policy}"])


def _rl_and_summary(args, cfg, run_dir: Path, cli: list[str], rl: list[str]) -> int:
    """Stages 3 and 4: RL with the overrides `rl` (resumed, or skipped once finished), then the summary."""
    done, finished = _rl_step(run_dir), run_dir / RL_FINISHED
    if finished.exists() and (run_dir / SUMMARY).exists():
        _say(f"3/3 RL: done ({done} updates in {run_dir / 'checkpoints'})")
        print(format_final(json.loads((run_dir / SUMMARY).read_text())), flush=True)
        return 0
    if finished.exists():
        _say(f"3/3 RL: done ({done} updates in {run_dir / 'checkpoints'})")
    else:
        _say(f"3/3 RL: {_budget(cfg)}" + (f", resuming at update {done}" if done else ""))
        flags = (["--resume", str(run_dir)] if done else []) + (["--sync"] if args.sync else []) + \
            (["--num-actors", str(args.num_actors)] if args.num_actors else [])
        if (code := _stage("RL", cli + ["train", args.config, *rl, *flags], lambda: _rl_step(run_dir))):
            return code
        finished.write_text(json.dumps({"updates": _rl_step(run_dir)}))
    summary = final_summary(cfg, run_dir)
    print(format_final(summary), flush=True)
    return 0


def final_summary(cfg, run_dir: Path) -> dict:
    """Success before RL (SFT's last evaluation, or the loaded policy's: RUN/policy_init) and after RL
    (the published weights of the last checkpoint, what the actors ran), on the same fixed initial
    states, sampled as actors sample."""
    from asyncvla.actors.evaluate import evaluate_policy, one_torch_thread
    from asyncvla.common.policy import load_policy
    from asyncvla.learner.export import load_checkpoint

    ran_sft = (run_dir / "sft" / "summary.json").exists()
    episodes = cfg.sft.eval_episodes if ran_sft else cfg.eval.num_episodes  # (SFT's own were that many)

    def evaluate(policy, env_cfg):
        with one_torch_thread():            # (as SFT's evaluations: actors/evaluate.py)
            return evaluate_policy(policy, env_cfg, policy.cfg, episodes, greedy=False,
                                   seed=cfg.env.seed, num_envs=cfg.eval.num_envs)

    policy, rl_cfg, source = load_checkpoint(run_dir, weights="ema")
    rl = evaluate(policy, rl_cfg.env)
    if ran_sft:
        sft = json.loads((run_dir / "sft" / "summary.json").read_text())
        last = sft["history"][-1]
        before = {"sft": {"steps": sft["steps"], "success_rate": last["success_rate"],
                          "ci95": [last["success_ci_low"], last["success_ci_high"]],
                          **({"tasks": last["tasks"]} if "tasks" in last else {})}}
    else:
        loaded = evaluate(load_policy(run_dir / "policy_init"), rl_cfg.env)
        before = {"loaded": {"path": cfg.policy.pretrained_path, **_figures(loaded)}}
    summary = {
        "env_id": cfg.env.id, "episodes": episodes, "sampled": True, **before,
        "rl": {"updates": source["step"], **_figures(rl)},
        "tensorboard": [str(run_dir / "sft" / "tb")] * ("sft" in before) + [str(run_dir / "tb")],
        "videos": _latest_videos(run_dir)}
    (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _figures(summary: dict) -> dict:
    """An evaluation's success rate and interval, and with env.tasks each task's."""
    out = {"success_rate": summary["success_rate"], "ci95": summary["success_ci95"]}
    if "tasks" in summary:
        out["tasks"] = {k: {"success_rate": t["success_rate"], "ci95": t["success_ci95"]}
                        for k, t in summary["tasks"].items()}
    return out


def format_final(s: dict) -> str:
    width = 26 + max([len(k) + 1 for k in s["rl"].get("tasks", {})] or [0])

    def line(label, r):
        lo, hi = r["ci95"]
        return f"  {label:{width}s} {100 * r['success_rate']:5.1f}%  95% CI [{100 * lo:.1f}, {100 * hi:.1f}]"

    def lines(label, r):           # (env.tasks: each task's, then their mean)
        return [line(f"{label} {k}", t) for k, t in r.get("tasks", {}).items()] + \
            [line(label + (" mean" if "tasks" in r else ""), r)]
    before = (lines(f"after SFT ({s['sft']['steps']} steps):", s["sft"]) if "sft" in s
              else lines("as loaded:", s["loaded"]))
    return "\n".join([
        f"asyncvla pipeline: {s['env_id']}, {s['episodes']} fixed episodes"
        + (" per task" if "tasks" in s["rl"] else "") + ", actions sampled as actors sample",
        *before, *lines(f"after RL ({s['rl']['updates']} updates):", s["rl"]),
        f"  {tensorboard_command(s['tensorboard'])}"]
        + ([f"  videos of the evaluator's last evaluation: {s['videos']}"] if s.get("videos") else []))


def tensorboard_command(log_dirs: list[str]) -> str:
    """The tensorboard command that shows every run in `log_dirs` (SFT's and RL's): one --logdir,
    their common parent, which tensorboard searches for runs (named by their path under it).
    tensorboard keeps only the last of several --logdir flags, and --logdir_spec, which takes
    several, misreads paths with a comma or colon."""
    return f"tensorboard --logdir {shlex.quote(os.path.commonpath(log_dirs))}"


def _latest_videos(run_dir: Path) -> str | None:
    """The newest RUN/eval/step_N/ holding the periodic evaluator's videos, if any."""
    steps = sorted(d for d in (run_dir / "eval").glob("step_*") if any(d.glob("*.mp4")))
    return str(steps[-1]) if steps else None


def _budget(cfg) -> str:
    lc = cfg.learner
    parts = [f"{lc.max_steps} updates"]
    if lc.max_env_steps:
        parts.append(f"{lc.max_env_steps} env steps")
    if lc.max_time_s:
        parts.append(f"{lc.max_time_s:.0f} s")
    return "up to " + " / ".join(parts)


def _rl_step(run_dir: Path):
    """Updates done by the latest complete RL checkpoint of run_dir, or None."""
    from asyncvla.learner import checkpoint
    if not (run_dir / checkpoint.CHECKPOINTS).is_dir():
        return None
    latest = checkpoint.find_latest(run_dir)
    return None if latest is None else int(checkpoint.read_marker(latest)["step"])


def _stage(name: str, cmd: list[str], progress=None) -> int:
    """Run one stage's command: 0 when it finished, 128 + the signal when it was interrupted (130
    Ctrl-C, 143 SIGTERM; one line says where), 1 when it failed. `progress()` names how far an interrupted stage got (RL: the
    update its newest checkpoint holds)."""
    code, signals = _call(cmd)
    if signals or code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        done = progress() if progress is not None else None
        where = f" at update {done or 0}" if progress is not None else ""
        print(f"asyncvla pipeline: interrupted during {name}{where}; the same command continues", file=sys.stderr,
              flush=True)
        # 128 + the first signal that reached the pipeline (or its stage): 130 for Ctrl-C, 143 for SIGTERM
        return 128 + (signals[0] if signals else code - 128)
    if code:
        print(f"asyncvla pipeline: '{' '.join(cmd[3:5])}' failed with exit code {code}", file=sys.stderr)
        return 1
    return 0


def _call(cmd: list[str]) -> tuple[int, list[int]]:
    """Run `cmd` in its own session; each SIGINT or SIGTERM this process gets is passed on to it,
    once (a terminal's Ctrl-C reaches only this process then), and the child is waited for, never
    killed here: an RL stage may be writing its final checkpoint. (exit code, signals passed on)"""
    me, received = os.getpid(), []
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: die_with_parent(me))

    def forward(signum, frame):
        received.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(), received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(msg: str) -> None:
    print(f"asyncvla pipeline: {msg}", flush=True)
