"""Learning speed over seeds: time and env steps to a success rate, asynchronous vs synchronous.

What users buy is reaching a success rate sooner, so this is the product's headline benchmark.
From ONE warm start per kind of action head (the task's demos + SFT, made once with `asyncvla
collect` and `asyncvla sft` and cached under OUT/learning/), each arm runs `asyncvla train CONFIG
policy.pretrained_path=SFT` once per seed (env.seed, actor.seed and learner.seed).
Three tasks (--task):
    pixel      configs/pixel_task.yaml, either cost profile below (the default). Runs end by
               progress: once the episodes the learner trained on succeed 5 points above the
               headline threshold over two windows of 128 in a row (learner.target_success), or
               at an update cap, so that every run reaches the threshold on a fast or a slow
               machine alike.
               Full: headline 80 %, 5 seeds, 128 episodes, ~2.5 h on 2 cores (an estimate from
               the quick runs); --quick: 70 %, 3 seeds, 64 episodes, sync and async only (the same
               logic, smaller), 29-30 min on 2 cores.
    maniskill  configs/maniskill.yaml, what `make train` runs: PushCube-v1 at the real simulator's
               cost (plain), the learner and the actors on disjoint cores in both arms; its own
               thresholds (RL lifts its 75-85 % warm start to ~88-93 %) and wall-clock budgets,
               OUT/learning_maniskill/ (full: 2 arms x 3 seeds ~3.5 h on 2 cores: `--arms sync,async`)
    heads      the pixel task at its own speed (plain), the token head against the flow head
               (Flow-SDE and Flow-Noise), asynchronous, each from its own warm start (the flow
               head's: 900 steps of flow-matching SFT), 15 min of RL per run (--quick: 10 min,
               no Flow-Noise); reports whether each run ends above its warm start, and each
               arm's end against the token head's. Full: 3 arms x 3 seeds, ~2.5 h.
    gaussian   the pixel task (plain), the Gaussian head (policy.action_head=gaussian) against the
               parallel token head, each from its own warm start of the same number of SFT steps
               (600), 15 min of RL per run, 3 seeds; each arm's end against the parallel head's.
    advantages the pixel task (plain), GAE (algorithm.adv_type=gae) against V-trace from the token
               head's warm start, 15 min of RL per run (--quick: 10 min), 3 seeds; GAE's end
               against V-trace's.
The arms (full: sync, async and the two large-lag ones; --arms picks any):
    sync               --sync: rollout and training in series (today's synchronous VLA-RL loop)
    async              asynchronous, V-trace + PPO clipped around the behaviour policy (the default loss)
    async_decoupled    asynchronous, V-trace + decoupled PPO (algorithm.policy_loss=decoupled)
    async_nocorr       asynchronous, no off-policy correction (stale data treated as on-policy)
    async_lag4         async with weights published every 4 updates: data 2.5 updates old on average
    async_lag4_nocorr  the same lag, no correction: where V-trace should pay
    async_lag8(_nocorr) the same with a publish every 8 updates (a mean lag of ~4-5 updates)
    async_flow         async with the flow head (policy.action_head=flow, Flow-SDE), from its warm start
    async_flow_noise   the same with Flow-Noise (ReinFlow: every denoising step Gaussian, learned std)
    async_parallel     async with the parallel token head (policy.action_head=parallel), from its warm start
    async_gaussian     async with the Gaussian head (policy.action_head=gaussian), from its warm start
    async_gae          async with GAE's advantages (algorithm.adv_type=gae: the critic's, stale data
                       taken as on-policy)
    grpo, sync_grpo    GRPO (algorithm.adv_type=grpo: groups of episodes from one initial state, no
                       critic), asynchronous / in series: with sync and async, GRPO vs V-trace and
                       async vs sync read off one table (e.g. --task maniskill --arms sync,async,sync_grpo,grpo)
Seeds run in turn, every arm within a seed, so that drift in the machine's load falls on all arms.

Two cost profiles (--profile):
    model   a MODEL of seed 002's cost profile (OpenVLA-OFT on ManiSkill: 38.8 s of rollout
            against 32.3 s of training per PPO step). A short plain sync run measures this
            machine's training and rollout time per update, and env.sim_latency_ms is set so that
            rollout takes 38.8/32.3 of training: the envs then wait as if a simulator ran on other
            hardware, holding no core. It models where the time goes, not a GPU simulator's
            physics, noise or memory; the modelled sync runs' measured ratio is reported.
    plain   the pixel task at its own speed on this machine (rollout ~1/4 of training on 2 cores,
            so the overlap can win at most ~1.2x here).

Each arm checkpoints every few updates and keeps those at least the task's eval_gap_s apart;
after all training (so that evaluation never competes with it for cores), their published (EMA)
weights — what the actors were running — are evaluated on the same fixed initial states (sampled
as actors sample), placed at the wall time of their save (from the launcher's start: start-up
counts) and at the env steps the learner had consumed. The SFT policy is the point at time 0.
A run's time to a threshold is its first evaluation at or above it. Per arm and threshold: every
seed's figure, and the mean over seeds with a bootstrap 95 % interval where every seed reached
it. Each arm's ratio to sync (of the means, with a stratified bootstrap interval: seeds resampled
within each arm) at every threshold every run of the two reaches, with its resolution (the
interval spans the ratio x/÷ that factor: smaller differences are not detectable with these
seeds). Success at 2, 5 and 10 min (a run that ended holds its last evaluation), with its IQM
where there are 5 seeds. The headline is the task's top threshold (maniskill: the highest every
run reaches).

Prints a table, writes OUT/learning_TAG.csv (one row per evaluation of every run; TAG is the
profile for the pixel task, `maniskill` for ManiSkill), OUT/learning_TAG.png (mean success vs wall
time and vs env steps, 95 % bootstrap bands), OUT/learning_TAG.md (the tables in markdown, the
headline first) and the JSON (every run's figures).

    python -m tests.benchmarks.learning [--quick] [--task pixel|maniskill] [--profile model|plain]
                                        [--seeds N] [--arms a,b] [--out OUT/learning_TAG.json]
Each stage under OUT/learning/ (demos, warm start, calibration, each run) is reused only when it
was made with the same settings (OUT/learning/made_with/STAGE.json records them): a finished run
is evaluated again but not retrained.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.benchmarks import workload
from tests.benchmarks.report import Figure, at_most, main
from tests.support.ports import run_port_overrides

ARMS = {"sync": ["--sync"],
        "async": ["algorithm.policy_loss=behavior_clip"],
        "async_decoupled": ["algorithm.policy_loss=decoupled"],
        "async_nocorr": ["algorithm.off_policy_correction=none"],
        # a larger lag: weights published every 4 (8) updates, so the data trained on is older
        "async_lag4": ["algorithm.policy_loss=behavior_clip", "learner.publish_interval=4"],
        "async_lag4_nocorr": ["algorithm.off_policy_correction=none", "learner.publish_interval=4"],
        "async_lag8": ["algorithm.policy_loss=behavior_clip", "learner.publish_interval=8"],
        "async_lag8_nocorr": ["algorithm.off_policy_correction=none", "learner.publish_interval=8"],
        # the flow head (pi0's way of acting), from its own flow-matching warm start
        "async_flow": ["algorithm.policy_loss=behavior_clip", "policy.action_head=flow",
                       "policy.flow.noise_method=flow_sde"],
        "async_flow_noise": ["algorithm.policy_loss=behavior_clip", "policy.action_head=flow",
                             "policy.flow.noise_method=flow_noise"],
        # the parallel token head and the Gaussian head, each from its own warm start
        "async_parallel": ["algorithm.policy_loss=behavior_clip", "policy.action_head=parallel"],
        "async_gaussian": ["algorithm.policy_loss=behavior_clip", "policy.action_head=gaussian"],
        # GAE from the critic instead of V-trace (common/advantages/gae.py)
        "async_gae": ["algorithm.policy_loss=behavior_clip", "algorithm.adv_type=gae"],
        # critic-free group-relative advantages (algorithm.adv_type=grpo), asynchronous and in series
        "grpo": ["algorithm.adv_type=grpo"],
        "sync_grpo": ["--sync", "algorithm.adv_type=grpo"]}
FULL_ARMS = ("sync", "async", "async_lag4", "async_lag4_nocorr")     # --arms adds the others
QUICK_ARMS = ("sync", "async")
PROFILES = ("model", "plain")
SEED002 = {"rollout_s": 38.8, "train_s": 32.3}      # one PPO step of OpenVLA-OFT on ManiSkill (seeds/)
FIXED_TIMES_S = (120.0, 300.0, 600.0)               # success reported at these wall times


@dataclass(frozen=True)
class Task:
    """What the benchmark trains on, and the scale its budgets and thresholds are set for.

    A run ends by progress when `target` is set: once the newest TARGET_EPISODES episodes it
    trained on succeed target[quick] of the time (learner.target_success), or after
    max_updates[quick] updates, so that every run reaches the threshold on a fast or a slow
    machine. Otherwise it ends by its wall-clock budget."""
    config: str
    env_id: str
    profiles: tuple[str, ...]
    thresholds: tuple[float, ...]  # reported where reached, highest first
    eval_gap_s: dict              # quick -> evaluations at least this far apart in a run (s)
    episodes: dict                # quick -> evaluation episodes
    top: dict = field(default_factory=dict)       # quick -> the headline threshold (none: the highest all reach)
    target: dict = field(default_factory=dict)    # quick -> learner.target_success of every run
    max_updates: dict = field(default_factory=dict)   # quick -> the cap of a run that ends by progress
    budgets: dict = field(default_factory=dict)   # (quick, profile) -> wall-clock budget (s) per arm kind
    sft_args: tuple[str, ...] = ()
    head_sft: dict = field(default_factory=dict)   # head -> its arms' warm start (the token head's: sft_args)
    baseline: str = "async"         # the arm every other arm's end is compared with
    run_args: tuple[str, ...] = ()  # every run's overrides
    work_name: str = "learning"     # OUT/<work_name>: its cached stages
    tag: dict = field(default_factory=dict)   # profile -> output name (OUT/learning_<tag>.*)
    arms: dict = field(default_factory=lambda: {False: FULL_ARMS, True: QUICK_ARMS})   # quick -> default arms
    seeds: dict = field(default_factory=lambda: {False: 5, True: 3})                   # quick -> default seeds


TARGET_EPISODES = 128
TOKEN_SFT = ("policy.action_head=autoregressive",)
FLOW_SFT = ("policy.action_head=flow", "sft.steps=900")
HEAD_SFT_STEPS = 600              # the parallel and Gaussian heads' warm starts (docs/models.md)
TASKS = {
    # Runs end by progress: 5 points above the headline threshold over two windows of 128 training
    # episodes in a row. Stopped on one crossing of 75 %, 1 of 3 quick async runs evaluated at 61 %.
    "pixel": Task(workload.CONFIG, "PixelReach-v0", PROFILES, thresholds=(0.9, 0.8, 0.7, 0.6),
                  eval_gap_s={False: 30.0, True: 20.0}, episodes={False: 128, True: 64},
                  top={False: 0.8, True: 0.7}, target={False: 0.85, True: 0.75},
                  max_updates={False: 2000, True: 1200}, sft_args=TOKEN_SFT, head_sft={"flow": FLOW_SFT},
                  tag={"model": "model", "plain": "plain"}),
    # The two kinds of action head in the same RL budget (make train's 15 min), each from its own
    # warm start: the token head's is the pixel task's, the flow head's is 900 steps of
    # flow-matching SFT (where it starts to read the image: docs/models.md). The question is
    # whether RL lifts each run above its warm start and where each ends, so the budgets are wall time.
    "heads": Task(workload.CONFIG, "PixelReach-v0", ("plain",), thresholds=(0.95, 0.9, 0.85, 0.8),
                  eval_gap_s={False: 60.0, True: 60.0}, episodes={False: 128, True: 128},
                  budgets={(False, "plain"): {"sync": 900.0, "async": 900.0},
                           (True, "plain"): {"sync": 600.0, "async": 600.0}},
                  sft_args=TOKEN_SFT, head_sft={"flow": FLOW_SFT}, tag={"plain": "heads"},
                  arms={False: ("async", "async_flow", "async_flow_noise"), True: ("async", "async_flow")},
                  seeds={False: 3, True: 3}),
    # The Gaussian head (continuous, as ManiSkill's own PPO acts) against the parallel token head,
    # each from its own warm start of the same number of SFT steps, in the same RL budget.
    "gaussian": Task(workload.CONFIG, "PixelReach-v0", ("plain",), thresholds=(0.95, 0.9, 0.85, 0.8),
                     eval_gap_s={False: 60.0, True: 60.0}, episodes={False: 128, True: 128},
                     budgets={(False, "plain"): {"sync": 900.0, "async": 900.0},
                              (True, "plain"): {"sync": 600.0, "async": 600.0}},
                     head_sft={h: (f"policy.action_head={h}", f"sft.steps={HEAD_SFT_STEPS}")
                               for h in ("parallel", "gaussian")},
                     tag={"plain": "gaussian"}, baseline="async_parallel",
                     arms={False: ("async_parallel", "async_gaussian"), True: ("async_parallel", "async_gaussian")},
                     seeds={False: 3, True: 3}),
    # Two advantage estimators (common/advantages/) in the same RL budget from one warm start.
    "advantages": Task(workload.CONFIG, "PixelReach-v0", ("plain",), thresholds=(0.95, 0.9, 0.85, 0.8),
                       eval_gap_s={False: 60.0, True: 60.0}, episodes={False: 128, True: 128},
                       budgets={(False, "plain"): {"sync": 900.0, "async": 900.0},
                                (True, "plain"): {"sync": 600.0, "async": 600.0}},
                       sft_args=TOKEN_SFT, tag={"plain": "advantages"},
                       arms={False: ("async", "async_gae"), True: ("async", "async_gae")},
                       seeds={False: 3, True: 3}),
    # The real simulator's cost, nothing modelled: `make train`'s config from its own warm start,
    # the learner and the actors on disjoint cores in both arms (on 2 cores: one each). RL lifts
    # that warm start (75-85 %, 1,000 SFT steps) to ~88 % in 200 updates (~23 min) and ~93 % in 370,
    # hence high thresholds close together and wall-clock budgets.
    "maniskill": Task("configs/maniskill.yaml", "PushCube-v1", ("plain",),
                      thresholds=(0.95, 0.93, 0.9, 0.88, 0.85), eval_gap_s={False: 200.0, True: 150.0},
                      episodes={False: 128, True: 64},
                      budgets={(False, "plain"): {"sync": 2400.0, "async": 1800.0},
                               (True, "plain"): {"sync": 900.0, "async": 900.0}},
                      run_args=("launch.placement.learner=0", "launch.placement.actors=1"),
                      work_name="learning_maniskill", tag={"plain": "maniskill"}),
}
EVAL_SEED = 0
BOOTSTRAP = 10_000
CALIBRATION_UPDATES = 25
OUT_DIR = Path("bench_results")
MADE_WITH = "made_with"    # OUT/learning/made_with/STAGE.json: the settings a finished stage was made with
RUN_METHOD = 2             # bumped when a run's meaning changes while its overrides do not (2: the
                           # target must hold over two windows), so that older runs are not reused
RUN_TIMEOUT_S = 4 * 3600   # only catches a hang: a run ends by its target, update cap or wall budget


def run(quick: bool = False, out_dir: Path = OUT_DIR, profile: str | None = None, seeds: int | None = None,
        arms: tuple[str, ...] | None = None, fresh: bool = False, task: str = "pixel") -> dict:
    """Make the stages not yet made with these settings under out_dir/learning (all with `fresh`), evaluate."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; choose from {list(TASKS)}")
    t = TASKS[task]
    profile = profile or t.profiles[0]
    if profile not in t.profiles:
        raise ValueError(f"profile={profile!r} with task={task!r}; choose from {t.profiles}")
    arms = tuple(arms or t.arms[quick])
    seeds = seeds or t.seeds[quick]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    missing = sorted({head_of(a) for a in arms} - set(t.head_sft) - {"token"})
    if missing:
        raise ValueError(f"task={task!r} has no warm start for the {missing} head(s) of arms {list(arms)}")
    episodes = t.episodes[quick]
    work = out_dir / t.work_name
    if fresh:
        shutil.rmtree(work / MADE_WITH, ignore_errors=True)
    heads = sorted({head_of(a) for a in arms} | ({"token"} if profile == "model" else set()))
    policies = {head: warm_start(work, t, head) for head in heads}
    sft_points = {head: evaluate_policy_dir(policies[head], episodes, t.config) for head in heads}
    latency_ms, calibration = (calibrate(work, policies["token"], t) if profile == "model" else (0.0, None))
    stop = stop_rule(t, quick, profile)
    results = {"task": task, "baseline": t.baseline, "config": t.config, "env_id": t.env_id, "tag": t.tag[profile], "profile": profile,
               "thresholds": list(t.thresholds), "top": t.top.get(quick), "stop": stop,
               "sim_latency_ms": latency_ms, "calibration": calibration, "episodes": episodes,
               "eval_seed": EVAL_SEED, "seeds": list(range(seeds)),
               "sft": min(sft_points.values(), key=lambda p: p["success"]),     # the lower warm start
               "warm_starts": {a: sft_points[head_of(a)] for a in arms},
               "publish_interval": {a: publish_interval(a) for a in arms}, "runs": {a: {} for a in arms}}
    for seed in range(seeds):
        for arm in arms:
            name = run_name(t, profile, arm, seed)
            args = [*ARMS[arm], *t.run_args, *stop[arm], f"env.seed={seed}", f"actor.seed={seed}",
                    f"learner.seed={seed}", f"env.sim_latency_ms={latency_ms:.3f}"]
            settings = _settings(t.config, *args, warm_start=_settings(t.config, *warm_start_args(t, arm)),
                                 method=RUN_METHOD)
            if _made_with(work, name, settings):
                print(f"[learning] {name}: reusing the finished run", flush=True)
            else:
                print(f"[learning] {name}: {' '.join(stop[arm])}", flush=True)
                train(name, args, policies[head_of(arm)], work, t.config)
                prune_checkpoints(work / name, t.eval_gap_s[quick])
                _stamp(work, name, settings)
    for arm in arms:                 # evaluated after all training, so that no run shares its cores with it
        for seed in range(seeds):
            run_dir = work / run_name(t, profile, arm, seed)
            curve = [dict(sft_points[head_of(arm)], wall_s=0.0, env_steps=0, step=0)]
            curve += evaluate_checkpoints(run_dir, episodes, t.eval_gap_s[quick])
            results["runs"][arm][seed] = {"run_dir": str(run_dir), "curve": curve, **run_timing(run_dir)}
    results["summary"] = summarize(results)
    write_outputs(results, out_dir)
    return results


def stop_rule(t: Task, quick: bool, profile: str) -> dict[str, list[str]]:
    """Each arm's overrides that end its runs: by progress (the task's target) or by wall time."""
    if t.target:
        rule = [f"learner.target_success={t.target[quick]}", f"learner.target_success_episodes={TARGET_EPISODES}",
                f"learner.max_steps={t.max_updates[quick]}"]
        return {arm: rule for arm in ARMS}
    budgets = t.budgets[quick, profile]
    return {arm: [f"learner.max_time_s={budgets['sync' if '--sync' in ARMS[arm] else 'async']}"] for arm in ARMS}


def publish_interval(arm: str) -> int:
    return next((int(a.split("=")[1]) for a in ARMS[arm] if a.startswith("learner.publish_interval=")), 1)


def head_of(arm: str) -> str:
    """Which warm start an arm starts from: its policy.action_head, or 'token' (the config's head)."""
    return next((a.split("=", 1)[1] for a in ARMS[arm] if a.startswith("policy.action_head=")), "token")


def warm_start_args(t: Task, arm: str) -> tuple[str, ...]:
    """What an arm's warm start was made with beyond the config (the token head's: nothing, so
    that runs made before there were flow arms keep their stamps)."""
    return () if head_of(arm) == "token" else tuple(t.head_sft[head_of(arm)])


def run_name(t: Task, profile: str, arm: str, seed: int) -> str:
    return f"{t.tag[profile]}_{arm}_s{seed}"


def add_arguments(parser) -> list[str]:
    """This benchmark's own flags (report.main passes them to run)."""
    parser.add_argument("--task", choices=list(TASKS), default="pixel",
                        help="pixel: the pixel task from one SFT warm start; maniskill: make train's PushCube "
                             "config at the real simulator's cost (--profile plain), actors and learner on "
                             "disjoint cores; heads: the token head against the flow head on the pixel task, "
                             "each from its own warm start, 15 min of RL; gaussian: the Gaussian head against "
                             "the parallel token head the same way; advantages: GAE against V-trace from one "
                             "warm start")
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="model: seed 002's rollout:training ratio, modelled with env.sim_latency_ms; "
                             "plain: the task's own speed (default: model for pixel, plain for maniskill)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per arm (seeds 0..N-1; default 5, --quick 3; heads: 3)")
    parser.add_argument("--arms", type=lambda s: tuple(s.split(",")), default=None,
                        help=f"comma-separated subset of {','.join(ARMS)} (default: {','.join(FULL_ARMS)}; "
                             f"--quick: {','.join(QUICK_ARMS)})")
    return ["task", "profile", "seeds", "arms"]


# ---------------------------------------------------------------------------------------- stages
def warm_start(work: Path, task: Task, head: str = "token") -> Path:
    """demos + SFT of the `head` (token or flow) under `work`, made once (cached)."""
    name = "sft_run" if head == "token" else f"sft_run_{head}"
    demos, policy = work / "demos", work / name / "sft" / "policy"
    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    sft = list(task.sft_args if head == "token" else task.head_sft[head])
    if not _made_with(work, "demos", _settings(task.config)):
        shutil.rmtree(demos, ignore_errors=True)
        subprocess.run(cli + ["collect", task.config, "--out", str(demos)], check=True)
        _stamp(work, "demos", _settings(task.config))
        for stale in (work / MADE_WITH).glob("sft_run*.json"):
            stale.unlink()
    if not _made_with(work, name, _settings(task.config, *sft)):
        print(f"[learning] {name}: SFT {' '.join(sft)}", flush=True)
        shutil.rmtree(work / name, ignore_errors=True)
        subprocess.run(cli + ["sft", task.config, f"sft.data={demos}", f"logging.output_dir={work}",
                              f"logging.experiment_name={name}", "logging.progress=false", *sft], check=True)
        _stamp(work, name, _settings(task.config, *sft))
    return policy


def calibrate(work: Path, sft_policy: Path, task: Task) -> tuple[float, dict]:
    """env.sim_latency_ms that makes a sync run's rollout take SEED002's share of training.

    A plain sync run of CALIBRATION_UPDATES updates measures, per update, training (the learner's
    step) and rollout (the learner's wait for data, which in sync mode is weight sync + rollout);
    the latency adds the difference spread over the segment's env steps."""
    settings = _settings(task.config, "--sync", f"learner.max_steps={CALIBRATION_UPDATES}",
                         warm_start=_settings(task.config))
    name = "calibration"
    if not _made_with(work, name, settings):
        print(f"[learning] calibration: a plain sync run of {CALIBRATION_UPDATES} updates", flush=True)
        train(name, ["--sync", f"learner.max_steps={CALIBRATION_UPDATES}"], sft_policy, work, task.config)
        _stamp(work, name, settings)
    timing = run_timing(work / name)
    from asyncvla.common.config import load_config
    cfg = load_config(task.config)
    env_steps_per_segment = cfg.actor.rollout_length * cfg.policy.num_action_chunks
    target = timing["train_s"] * SEED002["rollout_s"] / SEED002["train_s"]
    latency_ms = 1000.0 * max(0.0, target - timing["rollout_s"]) / env_steps_per_segment
    print(f"[learning] calibration: train {timing['train_s']:.2f} s, rollout {timing['rollout_s']:.2f} s per "
          f"update -> env.sim_latency_ms={latency_ms:.2f} (target rollout {target:.2f} s)", flush=True)
    return latency_ms, {**timing, "target_rollout_s": target, "env_steps_per_segment": env_steps_per_segment}


def _settings(config: str, *args: str, **more) -> dict:
    """What a cached stage depends on: the config file's bytes and the stage's own settings."""
    return {"config_sha256": hashlib.sha256(Path(config).read_bytes()).hexdigest(), "args": list(args), **more}


def _made_with(work: Path, stage: str, settings: dict) -> bool:
    stamp = work / MADE_WITH / f"{stage}.json"
    return stamp.exists() and json.loads(stamp.read_text()) == settings


def _stamp(work: Path, stage: str, settings: dict) -> None:
    """Record that `stage` finished with `settings` (written last, so an interrupted stage has none)."""
    (work / MADE_WITH).mkdir(parents=True, exist_ok=True)
    (work / MADE_WITH / f"{stage}.json").write_text(json.dumps(settings, indent=1))


def train(name: str, args: list[str], sft_policy: Path, work: Path, config: str) -> None:
    """One `asyncvla train` run into work/name (anew), until the budget in `args` ends it."""
    run_dir = work / name
    (work / MADE_WITH / f"{name}.json").unlink(missing_ok=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    flags = [a for a in args if a.startswith("--")]
    overrides = [a for a in args if not a.startswith("--")]
    max_steps = [] if any(a.startswith("learner.max_steps=") for a in overrides) else ["learner.max_steps=100000"]
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", config, *max_steps, *overrides,
           *run_port_overrides(), f"policy.pretrained_path={sft_policy}", f"logging.output_dir={work}",
           f"logging.experiment_name={name}", "logging.progress=false",
           "checkpoint.save_interval=5", "checkpoint.keep_last=100000", "eval.eval_interval=0",
           *flags]          # flags last: argparse takes no positional override after one
    subprocess.run(cmd, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)


def run_timing(run_dir: Path) -> dict:
    """Mean per update after the first 3: training time, time waiting for data (in sync mode
    weight sync + rollout), and the policy lag of the data trained on."""
    from tests.benchmarks.async_sync import read_scalars
    scalars = read_scalars(run_dir / "tb")

    def mean(tag):
        values = [v for step, _, v in scalars.get(tag, []) if step > 3]
        return float(np.mean(values)) if values else None
    return {"train_s": mean("time/learner_step_s"), "rollout_s": mean("time/learner_idle_s"),
            "policy_lag_mean": mean("rollout/policy_lag_mean"),
            "updates": max((s for s, _, _ in scalars.get("time/learner_step_s", [])), default=0)}


def evaluated_checkpoints(run_dir: Path, min_gap_s: float) -> list[Path]:
    """The checkpoints a run's curve is made of: at least min_gap_s of wall time apart (and the
    last one). Wall time counts from the launcher's start, when it wrote launch_config.yaml."""
    from asyncvla.learner import checkpoint

    tags = checkpoint.complete_tags(run_dir / checkpoint.CHECKPOINTS)
    chosen, last_t = [], (run_dir / "launch_config.yaml").stat().st_mtime
    for i, tag in enumerate(tags):
        t = checkpoint.read_marker(tag)["saved_at"]
        if t - last_t >= min_gap_s or i == len(tags) - 1:
            chosen.append(tag)
            last_t = t
    return chosen


def prune_checkpoints(run_dir: Path, min_gap_s: float) -> None:
    """Delete the checkpoints no evaluation reads: a run saves every 5 updates for the curve's
    resolution, ~2 GB per pixel-task run, of which one in ~15 is evaluated."""
    from asyncvla.learner import checkpoint

    keep = set(evaluated_checkpoints(run_dir, min_gap_s))
    for tag in checkpoint.complete_tags(run_dir / checkpoint.CHECKPOINTS):
        if tag not in keep:
            shutil.rmtree(tag)


def evaluate_checkpoints(run_dir: Path, episodes: int, min_gap_s: float) -> list[dict]:
    """Each evaluated checkpoint's success, at its wall time, env steps and update."""
    from asyncvla.learner import checkpoint
    from asyncvla.learner.export import load_checkpoint

    started = (run_dir / "launch_config.yaml").stat().st_mtime
    points = []
    for tag in evaluated_checkpoints(run_dir, min_gap_s):
        marker = checkpoint.read_marker(tag)
        state = checkpoint.read_client_state(tag)
        policy, cfg, _ = load_checkpoint(tag, weights="ema")
        point = evaluate(policy, cfg, episodes)
        point.update(wall_s=marker["saved_at"] - started, env_steps=int(state["env_steps"]),
                     step=int(state["step"]))
        points.append(point)
    return points


def evaluate_policy_dir(policy_dir: Path, episodes: int, config: str) -> dict:
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import VLAPolicy
    return evaluate(VLAPolicy.from_pretrained(str(policy_dir)), load_config(config), episodes)


def evaluate(policy, cfg, episodes: int) -> dict:
    from asyncvla.actors.evaluate import evaluate_policy
    s = evaluate_policy(policy, cfg.env, policy.cfg, episodes, greedy=False, seed=EVAL_SEED)
    return {"success": s["success_rate"], "ci_low": s["success_ci95"][0], "ci_high": s["success_ci95"][1]}


# ---------------------------------------------------------------------------------------- statistics
def first_reaching(curve: list[dict], threshold: float) -> dict | None:
    return next((p for p in curve if p["success"] >= threshold), None)


def resampled_means(values, rng: np.random.Generator, n: int = BOOTSTRAP) -> np.ndarray:
    """The means of n resamples (with replacement) of `values`."""
    v = np.asarray(values, dtype=float)
    return v[rng.integers(0, len(v), size=(n, len(v)))].mean(axis=1)


def bootstrap_mean(values, rng: np.random.Generator, n: int = BOOTSTRAP) -> tuple[float, float, float]:
    """Mean of `values` and the 95 % percentile interval of the means of n resamples."""
    means = resampled_means(values, rng, n)
    return float(np.mean(values)), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_ratio(num, den, rng: np.random.Generator, n: int = BOOTSTRAP) -> tuple[float, float, float]:
    """mean(num) / mean(den) and its 95 % stratified bootstrap interval (each arm resampled alone)."""
    ratios = resampled_means(num, rng, n) / resampled_means(den, rng, n)
    return float(np.mean(num) / np.mean(den)), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def bootstrap_diff(a, b, rng: np.random.Generator, n: int = BOOTSTRAP) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its 95 % stratified bootstrap interval (each arm resampled alone)."""
    diffs = resampled_means(a, rng, n) - resampled_means(b, rng, n)
    return float(np.mean(a) - np.mean(b)), float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def iqm(values) -> float:
    """Interquartile mean: the mean of the middle half (25 % trimmed each side, whole runs)."""
    v = np.sort(np.asarray(values, dtype=float))
    k = int(0.25 * len(v))
    return float(v[k:len(v) - k].mean())


def bootstrap_iqm(values, rng: np.random.Generator, n: int = BOOTSTRAP) -> tuple[float, float, float]:
    v = np.asarray(values, dtype=float)
    stats = [iqm(v[idx]) for idx in rng.integers(0, len(v), size=(n, len(v)))]
    return iqm(v), float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


def step_curve(curve: list[dict], key: str, grid: np.ndarray) -> np.ndarray:
    """Success of the last evaluation at or before each grid point. Past a run's end, its last
    evaluation holds: a run ends by its target (or cap), so it would not have fallen back."""
    xs = np.array([p[key] for p in curve], dtype=float)
    ys = np.array([p["success"] for p in curve], dtype=float)
    idx = np.searchsorted(xs, grid, side="right") - 1
    return ys[np.clip(idx, 0, None)]


def band(curves: list[list[dict]], key: str, grid: np.ndarray, rng) -> dict:
    """Mean success over runs at each grid point with its bootstrap 95 % interval."""
    ys = np.stack([step_curve(c, key, grid) for c in curves])
    mean, lo, hi = (np.array(s) for s in zip(*[bootstrap_mean(ys[:, j], rng, 2000) for j in range(len(grid))]))
    return {"x": grid.tolist(), "mean": mean.tolist(), "low": lo.tolist(), "high": hi.tolist()}


def summarize(results: dict) -> dict:
    """Per arm: time and env steps to each threshold (every seed's; mean and 95 % CI where every
    seed reached it), success at end and at fixed wall times; each arm against sync at every
    threshold every run of the pair reaches; the headline threshold (the task's top, else the
    highest every run reaches) and what the ratio there can resolve."""
    rng = np.random.default_rng(0)
    runs = results["runs"]
    all_curves = [r["curve"] for arm in runs.values() for r in arm.values()]
    # a threshold the warm start already reaches would be reached at time 0 by every run
    thresholds = [th for th in results["thresholds"] if th > results["sft"]["success"]]
    reached_by_all = [th for th in thresholds if all(first_reaching(c, th) for c in all_curves)]
    threshold = results.get("top") or (reached_by_all[0] if reached_by_all else None)
    out = {"threshold": threshold, "thresholds": thresholds, "arms": {}, "ratios": {}, "bands": {}}
    t_max = max(max(p["wall_s"] for p in c) for c in all_curves)
    s_max = max(max(p["env_steps"] for p in c) for c in all_curves)
    interval = results.get("publish_interval", {})
    for arm, seeds in runs.items():
        curves = [r["curve"] for r in seeds.values()]
        p_int = interval.get(arm, 1)
        warm = results.get("warm_starts", {}).get(arm, results["sft"])
        a = {"per_seed": {}, "to": {}, "warm_start": warm}
        for seed, r in seeds.items():
            hits = {th: first_reaching(r["curve"], th) for th in thresholds}
            lag = r["policy_lag_mean"]
            end = r["curve"][-1]
            a["per_seed"][seed] = {
                "to": {th: h and {"wall_s": h["wall_s"], "env_steps": h["env_steps"]} for th, h in hits.items()},
                "final_success": end["success"], "final_ci": [end["ci_low"], end["ci_high"]],
                "raised": end["ci_low"] > warm["ci_high"],      # RL's lower bound above SFT's upper
                "updates": r["updates"],
                "train_s": r["train_s"], "rollout_s": r["rollout_s"], "policy_lag_mean": lag,
                # data trained at step s came from weights published at a multiple of the interval
                "lag_updates": None if lag is None else p_int * lag + (p_int - 1) / 2,
                "end_wall_s": r["curve"][-1]["wall_s"]}
        per = list(a["per_seed"].values())
        for th in thresholds:
            hits = [p["to"][th] for p in per]
            entry = {"reached": sum(h is not None for h in hits), "of": len(hits)}
            if all(hits):
                entry.update({k: bootstrap_mean([h[k] for h in hits], rng) for k in ("wall_s", "env_steps")})
            a["to"][th] = entry
        a["final_success"] = bootstrap_mean([p["final_success"] for p in per], rng)
        at = {}
        for t in FIXED_TIMES_S:
            values = [float(step_curve(c, "wall_s", np.array([t]))[0]) for c in curves]
            at[t] = {"mean": bootstrap_mean(values, rng), **({"iqm": bootstrap_iqm(values, rng)} if len(values) >= 5
                                                              else {})}
        a["at_time"] = at
        out["arms"][arm] = a
        out["bands"][arm] = {"wall_s": band(curves, "wall_s", np.linspace(0, t_max, 81), rng),
                             "env_steps": band(curves, "env_steps", np.linspace(0, s_max, 81), rng)}
    if "sync" in runs:           # each arm against sync at every threshold every run of the two reaches
        for arm in runs:
            if arm == "sync":
                continue
            out["ratios"][arm] = {}
            for th in thresholds:
                hits = {name: [first_reaching(r["curve"], th) for r in runs[name].values()] for name in ("sync", arm)}
                if not all(hits["sync"] + hits[arm]):
                    continue
                ratio = {k: bootstrap_ratio([h[k] for h in hits[arm]], [h[k] for h in hits["sync"]], rng)
                         for k in ("wall_s", "env_steps")}
                lo, hi = ratio["wall_s"][1:]
                ratio["resolution"] = float(np.sqrt(hi / lo))     # the interval spans ratio x/÷ this
                out["ratios"][arm][th] = ratio
        out["sync_rollout_to_train"] = [s["rollout_s"] / s["train_s"] for s in out["arms"]["sync"]["per_seed"].values()]
    base = results.get("baseline", "async")
    if base in runs:             # where each other arm ends against the baseline arm, in success
        finals = {arm: [r["curve"][-1]["success"] for r in seeds.values()] for arm, seeds in runs.items()}
        out["final_vs_baseline"] = {arm: bootstrap_diff(finals[arm], finals[base], rng)
                                    for arm in runs if arm not in (base, "sync")}
    return out


# ---------------------------------------------------------------------------------------- report
def title(results: dict) -> str:
    if results["profile"] == "model":
        return (f"{results['env_id']}, MODEL of seed 002's cost profile (rollout:training 38.8:32.3 via "
                f"env.sim_latency_ms={results['sim_latency_ms']:.1f})")
    return f"{results['env_id']}, plain profile (the task's own speed on this machine)"


def write_outputs(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    profile, tag = results["profile"], results["tag"]
    with open(out_dir / f"learning_{tag}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["profile", "arm", "seed", "wall_s", "env_steps", "step", "success", "ci_low", "ci_high"])
        for arm, seeds in results["runs"].items():
            for seed, r in seeds.items():
                for p in r["curve"]:
                    w.writerow([profile, arm, seed, round(p["wall_s"], 1), p["env_steps"], p["step"], p["success"],
                                round(p["ci_low"], 4), round(p["ci_high"], 4)])
    plot(results, out_dir / f"learning_{tag}.png")
    (out_dir / f"learning_{tag}.md").write_text(markdown(results))


def _m(m, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """`mean [low, high]` of a bootstrap triple."""
    return f"{fmt.format(m[0] / scale)} [{fmt.format(m[1] / scale)}, {fmt.format(m[2] / scale)}]"


def _pct(m) -> str:
    return f"{100 * m[0]:.0f} % [{100 * m[1]:.0f}, {100 * m[2]:.0f}]"


def _per_seed(per: dict, th: float, key: str = "wall_s", scale: float = 1.0) -> str:
    return ", ".join("-" if p["to"].get(th) is None else f"{p['to'][th][key] / scale:.0f}" for p in per.values())


def markdown(results: dict) -> str:
    """The results in markdown (docs/results.md's form). First the headline table: per arm, time and env steps to the headline threshold (mean over seeds, 95 %
    bootstrap CI, each seed) and the ratio to sync; then every threshold, every seed's figures and
    success at fixed wall times."""
    s = results["summary"]
    th, n = s["threshold"], len(results["seeds"])
    if th is None:
        return f"No threshold of {tuple(results['thresholds'])} is reached by every run.\n"
    lines = [f"| arm ({n} seeds) | time to {th:.0%} (s) | per seed | env steps to {th:.0%} (k) | time / sync | "
             f"env steps / sync | success at end | updates | lag (updates) | wait / train (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        to, per = a["to"][th], a["per_seed"]
        ratio = s["ratios"].get(arm, {}).get(th)
        time_cell = _m(to["wall_s"]) if "wall_s" in to else f"{to['reached']}/{to['of']} reached"
        steps_cell = _m(to["env_steps"], 1e3) if "env_steps" in to else "-"
        ratio_cells = (f"{_m(ratio['wall_s'], fmt='{:.2f}')} | {_m(ratio['env_steps'], fmt='{:.2f}')}" if ratio
                       else ("-" if arm == "sync" or "sync" not in s["arms"] else "not reached by all") + " | -")
        pv = list(per.values())
        lines.append(f"| {arm} | {time_cell} | {_per_seed(per, th)} | {steps_cell} | {ratio_cells} | "
                     f"{_pct(a['final_success'])} | {np.mean([p['updates'] for p in pv]):.0f} | "
                     f"{_mean_of(pv, 'lag_updates'):.1f} | {_mean_of(pv, 'rollout_s'):.1f} / "
                     f"{_mean_of(pv, 'train_s'):.1f} |")
    lines += ["", "Every threshold (mean [95 % CI] where every seed reached it, else how many did; each seed's "
                  "figure in the table below):", "",
              "| arm | " + " | ".join(f"time to {t:.0%} (s)" for t in s["thresholds"]) + " |",
              "|---|" + "---|" * len(s["thresholds"])]
    for arm, a in s["arms"].items():
        cells = [_m(a["to"][t]["wall_s"]) if "wall_s" in a["to"][t] else f"{a['to'][t]['reached']}/{a['to'][t]['of']}"
                 for t in s["thresholds"]]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if s["ratios"]:
        lines += ["", "| arm / sync | threshold | time ratio [95 % CI] | env steps ratio [95 % CI] | "
                      "resolution (CI spans ratio x/÷) |", "|---|---|---|---|---|"]
        for arm, by_th in s["ratios"].items():
            for t, r in by_th.items():
                lines.append(f"| {arm} | {t:.0%} | {_m(r['wall_s'], fmt='{:.2f}')} | "
                             f"{_m(r['env_steps'], fmt='{:.2f}')} | {r['resolution']:.2f} |")
    lines += ["", "Every seed: time (s) and env steps (k) to each threshold, success at end, updates:", "",
              "| arm | seed | " + " | ".join(f"to {t:.0%}" for t in s["thresholds"]) + " | end | updates |",
              "|---|---|" + "---|" * (len(s["thresholds"]) + 2)]
    for arm, a in s["arms"].items():
        for seed, p in a["per_seed"].items():
            cells = ["-" if p["to"][t] is None else f"{p['to'][t]['wall_s']:.0f} s, {p['to'][t]['env_steps'] / 1e3:.0f} k"
                     for t in s["thresholds"]]
            lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + f" | {100 * p['final_success']:.0f} % "
                         f"({p['end_wall_s']:.0f} s) | {p['updates']} |")
    lines += ["", "Success at fixed wall times (mean [95 % CI]" + (", IQM [95 % CI]" if n >= 5 else "")
              + "; a run that ended holds its last evaluation):", "",
              "| arm | " + " | ".join(f"at {t / 60:.0f} min" for t in FIXED_TIMES_S) + " |",
              "|---|" + "---|" * len(FIXED_TIMES_S)]
    for arm, a in s["arms"].items():
        cells = [_pct(a["at_time"][t]["mean"]) + (f"; IQM {_pct(a['at_time'][t]['iqm'])}" if "iqm" in a["at_time"][t]
                                                   else "") for t in FIXED_TIMES_S]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    versus = s.get("final_vs_baseline")       # (arms other than the baseline and sync, when it ran)
    base = results.get("baseline", "async")
    lines += ["", "From the warm start (success on the fixed episodes, 95 % Wilson CI; raised: the run's last "
                  "evaluation's lower bound above the warm start's upper bound)"
              + (f"; the end against {base}'s, in points (mean difference [95 % CI])" if versus else "") + ":", "",
              "| arm | warm start | end, per seed | raised |" + (f" end - {base} (points) |" if versus else ""),
              "|---|---|---|---|" + ("---|" if versus else "")]
    for arm, a in s["arms"].items():
        w, per = a["warm_start"], a["per_seed"].values()
        ends = ", ".join(_pct((p["final_success"], *p["final_ci"])) for p in per)
        vs = (versus or {}).get(arm)
        vs_cell = "" if not versus else " - |" if vs is None else \
            f" {100 * vs[0]:+.0f} [{100 * vs[1]:+.0f}, {100 * vs[2]:+.0f}] |"
        raised = sum(p["raised"] for p in per)
        lines.append(f"| {arm} | {_pct((w['success'], w['ci_low'], w['ci_high']))} | {ends} | {raised}/{len(per)} |{vs_cell}")
    return "\n".join(lines) + "\n"


def _mean_of(per_seed, key: str) -> float:
    """Mean over seeds of a per-update timing (nan where no run logged it)."""
    values = [p[key] for p in per_seed if p[key] is not None]
    return float(np.mean(values)) if values else float("nan")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3), sharey=True)
    for arm, bands in s["bands"].items():
        for ax, key, scale in ((axes[0], "wall_s", 60.0), (axes[1], "env_steps", 1000.0)):
            b = bands[key]
            x = np.array(b["x"]) / scale
            line, = ax.plot(x, b["mean"], label=f"{arm} (n={len(results['runs'][arm])})")
            ax.fill_between(x, b["low"], b["high"], alpha=0.2, color=line.get_color())
    if s["threshold"] is not None:
        for ax in axes:
            ax.axhline(s["threshold"], color="grey", ls=":", lw=1)
    axes[0].set_xlabel("wall time (min, from launch)")
    axes[1].set_xlabel("env steps (thousands)")
    axes[0].set_ylabel(f"success ({results['episodes']} fixed episodes)\nmean of seeds, 95% bootstrap band")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    axes[0].legend(loc="lower right")
    fig.suptitle(title(results) + "\n(a run that ended holds its last evaluation)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(m) -> str:
    fmt = "{:,.0f}" if abs(m[0]) >= 100 else "{:.2f}"
    return f"mean of seeds, 95% CI [{fmt.format(m[1])}, {fmt.format(m[2])}]"


def figures(results: dict) -> list[Figure]:
    s, profile, tag = results["summary"], results["profile"], results["tag"]
    bench = f"learning ({tag})"
    figs = []
    if results["calibration"] is not None:
        c = results["calibration"]
        figs.append(Figure(bench, "model: env.sim_latency_ms", results["sim_latency_ms"],
                           note=f"plain sync: train {c['train_s']:.2f} s, rollout {c['rollout_s']:.2f} s per update"))
    ratios = s.get("sync_rollout_to_train")
    if ratios:
        figs.append(Figure(bench, "sync: rollout / train time", float(np.mean(ratios)), "x",
                           "1.20 (seed 002)" if profile == "model" else "",
                           note="per seed " + ", ".join(f"{r:.2f}" for r in ratios)))
    th = s["threshold"]
    for arm, a in s["arms"].items():
        per = a["per_seed"]
        to = a["to"].get(th) if th is not None else None
        if to is not None and "wall_s" in to:
            figs.append(Figure(bench, f"{arm}: time to {th:.0%}", to["wall_s"][0], "s",
                               note=_ci(to["wall_s"]) + "; seeds " + _per_seed(per, th)))
            figs.append(Figure(bench, f"{arm}: env steps to {th:.0%}", to["env_steps"][0], note=_ci(to["env_steps"])))
        elif to is not None:
            figs.append(Figure(bench, f"{arm}: time to {th:.0%}", None,
                               note=f"reached by {to['reached']} of {to['of']} runs; seeds " + _per_seed(per, th)))
        figs.append(Figure(bench, f"{arm}: success at run end", a["final_success"][0], "%",
                           note=f"lag {_mean_of(per.values(), 'lag_updates'):.1f} updates, "
                                f"{np.mean([p['updates'] for p in per.values()]):.0f} updates"))
    if th is None:
        figs.append(Figure(bench, "time to threshold", None,
                           note=f"no threshold of {tuple(results['thresholds'])} every run reaches"))
    for arm, by_th in s["ratios"].items() if th is not None else ():
        r = by_th.get(th)
        if r is None:
            figs.append(Figure(bench, f"{arm} / sync: time to {th:.0%}", None, note="not reached by every run"))
            continue
        goal = "<= 0.6, CI high < 0.8" if profile == "model" else ""
        met = (at_most(r["wall_s"][0], 0.6) and r["wall_s"][2] < 0.8) if profile == "model" else None
        figs.append(Figure(bench, f"{arm} / sync: time to {th:.0%}", r["wall_s"][0], "x", goal, met,
                           note=f"95% CI [{r['wall_s'][1]:.2f}, {r['wall_s'][2]:.2f}]: with these seeds the "
                                f"interval spans the ratio x/÷ {r['resolution']:.2f}"))
        figs.append(Figure(bench, f"{arm} / sync: env steps to {th:.0%}", r["env_steps"][0], "x", "<= 1.15",
                           at_most(r["env_steps"][0], 1.15), note=f"95% CI [{r['env_steps'][1]:.2f}, {r['env_steps'][2]:.2f}]"))
    figs.append(Figure(bench, "outputs", None, note=f"wrote learning_{tag}.csv, .md and .png"))
    return figs


if __name__ == "__main__":
    main(sys.modules[__name__])
