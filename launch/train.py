"""`asyncvla train CONFIG [overrides]`: the learner through the deepspeed launcher + local actors.

Wiring only: it resolves the config once, starts
    deepspeed [--hostfile H | --num_gpus R] --master_port P --module asyncvla.learner.main RESOLVED.yaml
and `launch.num_local_actors` actor processes that join the learner over ZeroMQ (plus, with
`eval.eval_interval`, an evaluator process: actors/evaluator.py), restarts an
actor that crashes (up to launch.max_actor_restarts), and when the learner ends — by its budget,
a crash or Ctrl-C — stops every child. Each child runs in its own process group so nothing is
orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncvla.common.config import Config, ConfigError, load_config, parse_overrides, to_yaml
from asyncvla.common.rundir import run_dir as run_dir_of_config


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train: DeepSpeed learner + local actor processes",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.num_envs=4")
    p.add_argument("--resume", metavar="RUN_DIR_OR_CKPT",
                   help="continue from a run directory's latest complete checkpoint, or a checkpoint")
    p.add_argument("--hostfile", help="deepspeed hostfile for multi-node learners (configs/hostfile.example)")
    p.add_argument("--sync", action="store_true",
                   help="serialise rollout and training (the synchronous baseline)")
    p.add_argument("--num-learner-ranks", type=int, help="learner ranks on this machine (launch.num_learner_ranks)")
    p.add_argument("--num-actors", type=int, help="local actor processes (launch.num_local_actors)")
    p.set_defaults(func=run)


def run(args) -> int:
    overrides = parse_overrides(args.overrides)
    for flag, key in ((args.resume, "checkpoint.resume"), (args.hostfile, "launch.hostfile"),
                      (args.num_learner_ranks, "launch.num_learner_ranks"),
                      (args.num_actors, "launch.num_local_actors")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    if args.sync:
        overrides.append("launch.sync=true")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"asyncvla: config error: {e}", file=sys.stderr)
        return 2
    return launch(cfg)


def launch(cfg: Config) -> int:
    run_dir = run_dir_of_config(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "launch_config.yaml"
    resolved.write_text(to_yaml(cfg))
    children = Children()
    _forward_signals(children)
    learner = children.start("learner", learner_command(cfg, resolved))
    control = f"tcp://{_connect_host(cfg)}:{cfg.transport.control_port}"
    keys = cfg.transport.keys_dir
    actors = {i: children.start(f"actor-{i}", actor_command(control, i, keys))
              for i in range(cfg.launch.num_local_actors)}
    restarts = {i: 0 for i in actors}
    evaluator = None
    if cfg.eval.eval_interval:
        evaluator = children.start("evaluator", evaluator_command(control, run_dir, keys))
    print(f"asyncvla: run dir {run_dir}; tensorboard --logdir {run_dir / 'tb'}", flush=True)
    try:
        while learner.poll() is None:
            time.sleep(0.5)
            for i, proc in list(actors.items()):
                code = proc.poll()
                if code is None or children.stopping:
                    continue
                if cfg.launch.restart_actors and restarts[i] < cfg.launch.max_actor_restarts and code != 0:
                    restarts[i] += 1
                    print(f"asyncvla: actor {i} exited with {code}; restart {restarts[i]}/"
                          f"{cfg.launch.max_actor_restarts}", file=sys.stderr, flush=True)
                    actors[i] = children.start(f"actor-{i}", actor_command(control, i, keys))
                    continue
                del actors[i]
                if code != 0:
                    print(f"asyncvla: actor {i} exited with {code}; giving up on it "
                          f"(launch.max_actor_restarts={cfg.launch.max_actor_restarts})", file=sys.stderr, flush=True)
                    if not actors:   # nothing left to feed the learner: waiting would hang the run
                        print("asyncvla: every local actor has failed; stopping the run (see the actor "
                              "errors above)", file=sys.stderr, flush=True)
                        return 1
        if learner.returncode == 0:   # the learner told the actors it is done: let them finish
            _wait_all(list(actors.values()), timeout=20.0)
            if evaluator is not None:   # ... and the evaluator its last evaluation
                _wait_all([evaluator], timeout=cfg.eval.final_eval_timeout_s)
        return learner.returncode
    finally:
        children.stop_all()


def learner_command(cfg: Config, resolved_config: Path) -> list[str]:
    ds = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(cfg.launch.master_port)]
    if cfg.launch.hostfile:
        ds += ["--hostfile", cfg.launch.hostfile]
    else:
        # On a CPU machine DeepSpeed counts NUMA nodes as devices; --num_gpus sets the rank count.
        ds += ["--num_gpus", str(cfg.launch.num_learner_ranks)]
    return ds + ["--module", "asyncvla.learner.main", str(resolved_config)]


def actor_command(control_endpoint: str, index: int, keys_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", control_endpoint,
           "--actor-id", f"local-{index}", "--actor-index", str(index)]
    return cmd + (["--keys-dir", keys_dir] if keys_dir else [])


def evaluator_command(control_endpoint: str, run_dir: Path, keys_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "asyncvla.actors.evaluator", "--learner", control_endpoint,
           "--run-dir", str(run_dir)]
    return cmd + (["--keys-dir", keys_dir] if keys_dir else [])


def _connect_host(cfg: Config) -> str:
    host = cfg.transport.advertise_host or cfg.transport.bind_host
    return "127.0.0.1" if host in ("0.0.0.0", "*") else host


class Children:
    """Child processes, each in its own session so a stop reaches its whole tree."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.stopping = False

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        self.procs.append((name, proc))
        return proc

    def stop_all(self, grace_s: float = 15.0) -> None:
        self.stopping = True
        for _, proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.time() + grace_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)   # the group may hold grandchildren (env workers)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return


def _signal_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _forward_signals(children: Children) -> None:
    def handler(signum, frame):
        children.stop_all()
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
