"""Actor scaling: env steps/s of k actor processes against k x one actor, k = 1, 2, 4, ... cores.

Why: actors are meant to scale out; on one machine k actors should give ~k times the env steps
of one until the cores run out. Each actor process is what an actor is, minus the sockets: its own
envs and its own policy copy (torch at 1 thread, as actors/main.py sets), running
`rollout.collect_segment` in a loop. The processes are built and warmed up once; then the first k
of them run together for the same wall time; rate = env steps / seconds of their complete
segments, summed over the k. Full mode repeats every k and keeps its best round (the machine
may be shared). Also each actor's CPU time / wall time (the cores one
actor keeps busy: above 1 means threads beyond the policy's, e.g. the software renderer).

  pixel      the benchmark workload (PixelReach-v0, 4 envs, T = 8)
  ManiSkill  configs/quickstart.yaml (PushCube-v1 from RGB, CPU physics, software renderer) with
             1 env per actor, in the actor's own process (2+ envs would add worker processes);
             once more for one actor with policy.action_head=parallel (one pass per chunk
             instead of one per action token), reported as the ratio of env steps/s

Goal (issue #9): k actors >= 0.85 * k x one actor, up to the core count.

  fleet      two actors started by `asyncvla train --actor-hostfile` on two loopback "hosts"
             (127.0.0.2 and .3, through a private sshd: tests/benchmarks/multinode.py), one
             each, against the same two actors started locally (launch.num_local_actors=2): the
             env steps/s the learner counts (rollout/env_steps in tensorboard, after its first
             5 updates), the arms alternating, the median of each. Goal: fleet >= 90 % of local.
             Needs root (the sshd); else the row says why it was skipped.

    python -m tests.benchmarks.actor_scaling [--quick] [--out bench_results/actor_scaling.json]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback

from tests.benchmarks import workload
from tests.benchmarks.report import CpuMeter, Figure, at_least, main

START_TIMEOUT_S = 300


def run(quick: bool = False) -> dict:
    cores = os.cpu_count() or 1
    counts = sorted({1, cores} | {k for k in (2, 4, 8, 16, 32) if k < cores})
    duration, rounds = (8.0, 1) if quick else (12.0, 2)
    from asyncvla.common.config import load_config, to_dict
    maniskill = ["actor.num_envs=1"]
    setups = {"pixel": (to_dict(workload.config()), counts),
              "maniskill": (to_dict(load_config(workload.MANISKILL_CONFIG, maniskill)), counts),
              # what the parallel action head does to an actor's env steps/s (issue #18): one actor
              "maniskill_parallel": (to_dict(load_config(workload.MANISKILL_CONFIG,
                                                         maniskill + ["policy.action_head=parallel"])), [1])}
    results = {"duration_s": duration, "rounds": rounds, "counts": counts}
    try:
        results["fleet"] = fleet_vs_local(quick)
    except Exception as e:                        # (reported in its row; the rest still runs)
        results["fleet"] = {"error": f"{type(e).__name__}: {e}"}
    for name, (cfg, ks) in setups.items():
        try:
            runs = scaling(cfg, ks, duration, rounds)
        except Exception as e:                    # e.g. no Vulkan device for ManiSkill: keep the rest
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        one = runs[0]["env_steps_per_s"]
        for r in runs:
            r["efficiency"] = r["env_steps_per_s"] / (r["actors"] * one)
        results[name] = {"env": cfg["env"]["id"], "num_envs": cfg["actor"]["num_envs"],
                         "rollout_length": cfg["actor"]["rollout_length"],
                         "action_head": cfg["policy"]["action_head"], "runs": runs}
    return results


def scaling(cfg: dict, counts: list[int], duration: float, rounds: int) -> list[dict]:
    """max(counts) actor processes, built once; in each round, for each k, the first k of them run
    together for `duration` s. Per k, the round with the most env steps/s (the least disturbed
    by other work on the machine) is kept."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(max(counts))]
    procs = [ctx.Process(target=_actor_main, args=(cfg, i, child)) for i, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        workload.collect(procs, pipes, START_TIMEOUT_S, "actor")           # built and warmed up
        best: dict[int, dict] = {}
        for _ in range(rounds):
            for k in counts:
                with CpuMeter() as cpu:
                    for parent, _ in pipes[:k]:
                        parent.send(duration)
                    records = workload.collect(procs, pipes[:k], duration + 120, f"actor (of {k})", close=False)
                run = {"actors": k, "env_steps_per_s": sum(r["env_steps"] / r["seconds"] for r in records),
                       "cores_per_actor": [r["cpu_s"] / r["seconds"] for r in records],
                       "machine_cores_busy": cpu.result["machine_cores_busy"], "per_actor": records}
                if k not in best or run["env_steps_per_s"] > best[k]["env_steps_per_s"]:
                    best[k] = run
        for parent, _ in pipes:
            parent.send(None)
        return [best[k] for k in counts]
    finally:
        workload.stop(procs)


FLEET_HOSTS = ("127.0.0.2", "127.0.0.3")
FLEET_OVERRIDES = ["eval.eval_interval=0", "actor.num_envs=4", "actor.rollout_length=8", "learner.batch_trajectories=8",
                   "algorithm.update_epochs=1", "algorithm.num_minibatches=1", "logging.progress=false",
                   "transport.bind_host=0.0.0.0", "checkpoint.save_interval=0",
                   "policy.backbone.text_layers=1", "policy.backbone.text_hidden_size=64",
                   "policy.backbone.intermediate_size=128", "policy.backbone.vision_hidden_size=32",
                   "policy.backbone.vision_layers=1", "policy.value_head_hidden=32"]


def fleet_vs_local(quick: bool) -> dict:
    """Env steps/s of 2 actors on 2 ssh "hosts" (one each) against 2 local actors, same learner."""
    import statistics
    import tempfile
    from contextlib import ExitStack
    from pathlib import Path

    from tests.benchmarks import multinode
    from tests.support.ports import free_ports, run_ports

    missing = multinode.prerequisites()
    if missing:
        return {"skipped": missing}
    steps, rounds = (40, 1) if quick else (80, 3)
    rates: dict[str, list[float]] = {"local": [], "fleet": []}
    with tempfile.TemporaryDirectory(prefix="asyncvla-fleet-") as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        stack.enter_context(multinode.ssh_nodes(tmp / "ssh", FLEET_HOSTS, free_ports(1)[0]))
        stack.callback(multinode._kill_leftovers, str(tmp))
        from asyncvla.launch.keygen import generate
        generate(tmp / "keys", len(FLEET_HOSTS))
        hostfile = tmp / "actor_hosts"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in FLEET_HOSTS))
        for r in range(rounds):
            for arm in ("local", "fleet"):
                ports = tuple(run_ports().values())       # the sshd's port is held, so not among them
                extra = ["launch.num_local_actors=0", "--actor-hostfile", str(hostfile)] if arm == "fleet" \
                    else ["launch.num_local_actors=2"]
                rates[arm].append(_train_rate(tmp, f"{arm}-{r}", steps, ports, extra))
    return {"hosts": list(FLEET_HOSTS), "updates": steps, "rounds": rounds, "env_steps_per_s": rates,
            "median": {arm: statistics.median(v) for arm, v in rates.items()}}


def _train_rate(tmp, name: str, steps: int, ports, extra: list[str]) -> float:
    """One `asyncvla train` to `steps` updates; the env steps/s its learner counted after update 5."""
    import subprocess

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.benchmarks.report import ROOT
    control, weights, trajectory, master = ports
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", workload.CONFIG, *FLEET_OVERRIDES,
           f"learner.max_steps={steps}", f"logging.output_dir={tmp / 'runs'}", f"logging.experiment_name={name}",
           f"transport.keys_dir={tmp / 'keys'}", f"transport.control_port={control}",
           f"transport.weights_port={weights}", f"transport.segment_port={trajectory}",
           f"launch.master_port={master}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        raise RuntimeError(f"{name}: asyncvla train exited with {r.returncode}: {(r.stdout + r.stderr)[-2000:]}")
    acc = EventAccumulator(str(tmp / "runs" / name / "tb"))
    acc.Reload()
    events = [e for e in acc.Scalars("rollout/env_steps") if e.step >= 5]
    first, last = events[0], events[-1]
    return (last.value - first.value) / (last.wall_time - first.wall_time)


def make_actor(cfg, index: int):
    """An actor minus its sockets: (segment, env); segment() acts one segment, returns its env steps."""
    import torch

    from asyncvla.actors import rollout
    from asyncvla.actors.envs import make_env
    from asyncvla.common.policy import VLAPolicy

    torch.set_num_threads(1)
    policy = VLAPolicy.build(cfg.policy)
    env = make_env(cfg.env, cfg.actor.num_envs, cfg.policy.image_size, cfg.policy.num_action_chunks,
                   cfg.algorithm.reward_type, seed=1000 * index, action_dim=cfg.policy.action_dim)
    tokenize, state = rollout.InstructionCache(policy), rollout.start(env)
    generator = torch.Generator().manual_seed(index)

    def segment() -> int:
        return rollout.collect_segment(env, policy, tokenize, state, cfg.actor.rollout_length,
                                       cfg.policy.temperature, generator)[1]["env_steps"]
    return segment, env


def _actor_main(cfg_dict: dict, index: int, conn) -> None:
    """Build, warm up, report ready; then for each duration received, act that long."""
    try:
        from asyncvla.common.config import from_dict
        segment, env = make_actor(from_dict(cfg_dict), index)
        segment()                                          # warm-up
        conn.send({"ready": True})
        while (duration := conn.recv()) is not None:
            t0, cpu0, steps = time.perf_counter(), time.process_time(), 0
            while time.perf_counter() - t0 < duration:
                steps += segment()
            conn.send({"env_steps": steps, "seconds": time.perf_counter() - t0,
                       "cpu_s": time.process_time() - cpu0})
        env.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    sys.stdout.flush()
    os._exit(0)


def figures(r: dict) -> list[Figure]:
    out = []
    for name, label in (("pixel", "pixel"), ("maniskill", "ManiSkill")):
        res = r[name]
        if "error" in res:
            out.append(Figure("actor scaling", f"{label}: env steps/s", None, note=res["error"][:120]))
            continue
        runs = res["runs"]
        out.append(Figure("actor scaling", f"{label}: 1 actor env steps/s", runs[0]["env_steps_per_s"], "/s",
                          note=f"{res['env']}, {res['num_envs']} env(s)/actor; one actor keeps "
                               f"{runs[0]['cores_per_actor'][0]:.2f} cores busy"))
        for run in runs[1:]:
            k = run["actors"]
            out.append(Figure("actor scaling", f"{label}: {k} actors / ({k} x 1 actor)", run["efficiency"], "%",
                              ">= 85 %", at_least(run["efficiency"], 0.85),
                              note=f"{run['env_steps_per_s']:.0f} env steps/s; cores per actor "
                                   + ", ".join(f"{c:.2f}" for c in run["cores_per_actor"])))
    fleet = r.get("fleet", {"skipped": "not run"})
    if "median" in fleet:
        local, remote = fleet["median"]["local"], fleet["median"]["fleet"]
        out.append(Figure("actor scaling", "fleet over ssh (2 hosts x 1 actor) / 2 local actors: env steps/s",
                          remote / local, "%", ">= 90 %", at_least(remote / local, 0.90),
                          note=f"medians {remote:.0f} vs {local:.0f} env steps/s over {fleet['rounds']} round(s); "
                               f"fleet {', '.join(f'{v:.0f}' for v in fleet['env_steps_per_s']['fleet'])}, local "
                               f"{', '.join(f'{v:.0f}' for v in fleet['env_steps_per_s']['local'])}"))
    else:
        out.append(Figure("actor scaling", "fleet over ssh / local actors: env steps/s", None,
                          note=f"skipped: {fleet.get('skipped', fleet.get('error', '?'))}"[:160]))
    par, ar = r.get("maniskill_parallel", {}), r["maniskill"]
    if "runs" in par and "runs" in ar:
        rate, base = par["runs"][0]["env_steps_per_s"], ar["runs"][0]["env_steps_per_s"]
        out.append(Figure("actor scaling", "ManiSkill: 1 actor env steps/s, parallel / autoregressive head",
                          rate / base, "x", note=f"{rate:.1f} against {base:.1f} env steps/s"))
    elif "error" in par:
        out.append(Figure("actor scaling", "ManiSkill, parallel head: env steps/s", None, note=par["error"][:120]))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
