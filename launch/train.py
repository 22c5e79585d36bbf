"""`asyncvla train CONFIG [overrides]`: the learner through the deepspeed launcher + local actors.

Wiring only: it resolves the config once, starts
    deepspeed [--hostfile H | --num_gpus R] --master_port P --module asyncvla.learner.main RESOLVED.yaml
and `launch.num_local_actors` actor processes that join the learner over ZeroMQ (plus, with
`eval.eval_interval`, an evaluator process: launch/evaluator.py), restarts an
actor that crashes (up to launch.max_actor_restarts), and when the learner ends stops every child.
With launch.placement (common/placement.py) the learner ranks and the actors run on the cores it
names: each rank pins itself to its slice, each actor to the cores given in $ASYNCVLA_CORES.

With launch.actor_hostfile (--actor-hostfile) it also starts an actor fleet on each host listed
there, over ssh (launch/fleet.py: `asyncvla actors`), before the learner is up; with CURVE keys,
the client bundles the hosts need are made in transport.keys_dir first.

Stopping: Ctrl-C (SIGINT) or SIGTERM asks the learner ranks to stop — SIGTERM to each rank
directly (once it has installed its handler: a rank still starting would die of it), because the
deepspeed runner dies on it at once and would take the ranks with it. They finish the current
update, write a final checkpoint, tell the actors ("shutdown") and exit; the launcher then names
the checkpoint and how to resume (`--resume RUN`), stops the actor fleets and exits with 130
(SIGINT) or 143 (SIGTERM): a stop is not a finish. The ranks get --stop-grace-s (60 s by default)
for that, counted from the moment the last of them is asked (a rank still starting is asked once it
can take the signal, up to STARTING_S after the stop); a second Ctrl-C, or a learner still running
after the grace period, kills the run (exit 1), which then resumes from its last complete
checkpoint. With --hostfile the ranks on other machines are out of the launcher's reach: a stop
kills the run.

Exit codes: 0 the learner ended by its budget (its record RUN/learner_end.json says so: an exit
code alone cannot tell); 130 / 143 stopped by SIGINT / SIGTERM, after the final checkpoint; 1 the
learner failed (non-finite training, a final checkpoint not written), every actor was lost, or
the run was killed; 2 a bad config or a run that cannot start. The checkpoint the launcher names
is the one the learner recorded: the newest step of the branch it trained (a run resumed from an
older checkpoint is that checkpoint's branch), from its completion marker.

Actors: a local actor that exits while the learner trains (a crash, a signal: anything but the
learner's "shutdown", after which it exits 0) is restarted up to launch.max_actor_restarts times;
when none is left, no actor fleet runs and no remote actor is registered with the learner (its
rank 0 keeps RUN/actors.json), the run stops (exit 1). An evaluator that dies is reported and
restarted once.

Each child runs in its own session, so a stop reaches its whole tree, and gets a parent-death
signal: a launcher killed with SIGKILL takes every process of the run with it within seconds
(the learner ranks, its grandchildren, watch its pid: common/signals.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from asyncvla.common import placement
from asyncvla.common.transport.auth import JOIN_SECRET_ENV, ensure_join_secret
from asyncvla.common.config import Config, ConfigError, load_config, parse_overrides, to_yaml
from asyncvla.common.transport.control import EVALUATOR_PREFIX
from asyncvla.common.rundir import clear_end, read_actors, read_end, run_dir as run_dir_of_config
from asyncvla.common.signals import LAUNCHER_PID_ENV, catches, descendants, die_with_parent, python_module
from asyncvla.launch import preflight
from asyncvla.launch.fleet import HostfileError

EVALUATOR_RESTARTS = 1       # an evaluator that dies is restarted this often, then evaluation stops
STOP_GRACE_S = 60.0          # for a stopping learner to finish its update and save (--stop-grace-s)
STARTING_S = 300.0           # for a learner rank still importing on a stop to become able to take it
FLEET_GONE_S = 30.0          # every actor host ended, no local actor: the learner waits this long to end
LEARNER_MODULE = "asyncvla.learner.main"


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train: DeepSpeed learner + local actor processes",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.num_envs=4")
    p.add_argument("--resume", metavar="RUN_DIR_OR_CKPT",
                   help="continue from a run directory's latest complete checkpoint, or a checkpoint")
    p.add_argument("--hostfile", help="deepspeed hostfile for multi-node learners (configs/hostfile.example)")
    p.add_argument("--actor-hostfile", help="hosts that each run an actor fleet over ssh, 'HOST slots=N' per line "
                                            "(launch.actor_hostfile; see `asyncvla actors --help`)")
    p.add_argument("--sync", action="store_true",
                   help="serialise rollout and training (the synchronous baseline)")
    p.add_argument("--num-learner-ranks", type=int, help="learner ranks on this machine (launch.num_learner_ranks)")
    p.add_argument("--num-actors", type=int, help="local actor processes (launch.num_local_actors)")
    p.add_argument("--stop-grace-s", type=float, default=STOP_GRACE_S, metavar="S",
                   help="on Ctrl-C, how long the learner may take to finish its update and write its "
                        "final checkpoint before the run is killed, counted from the moment its ranks "
                        "are asked (a rank still starting, once it can take the signal) (default %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    overrides = parse_overrides(args.overrides)
    for flag, key in ((args.resume, "checkpoint.resume"), (args.hostfile, "launch.hostfile"),
                      (args.actor_hostfile, "launch.actor_hostfile"),
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
    found = preflight.problems(cfg)
    for line in found:
        print(f"asyncvla: cannot start: {line}", file=sys.stderr)
    if found:
        return 2
    return launch(cfg, args.stop_grace_s)


def launch(cfg: Config, stop_grace_s: float = STOP_GRACE_S) -> int:
    run_dir = run_dir_of_config(cfg)
    resolved = run_dir / "launch_config.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved.write_text(to_yaml(cfg))
    except OSError as e:
        print(f"asyncvla: cannot write the run directory {run_dir}: {type(e).__name__}: {e}; it is "
              "logging.output_dir/logging.experiment_name: set logging.output_dir to a writable place",
              file=sys.stderr, flush=True)
        return 2
    # Without CURVE keys, the processes it starts join with the run's secret, handed in their
    # environment (a command line is visible to every user); the learner reads the same file.
    secret = None if cfg.transport.keys_dir else ensure_join_secret(run_dir)
    try:
        fleet = actor_fleet(cfg, run_dir, secret)
    except HostfileError as e:
        print(f"asyncvla: cannot start: launch.actor_hostfile: {e}", file=sys.stderr, flush=True)
        return 2
    children = Children({JOIN_SECRET_ENV: secret} if secret else {})
    stop = StopRequests()
    clear_end(run_dir)               # (the previous learner's record must not speak for this one)
    # (each learner rank pins itself to its slice: learner/main.py; an actor applies what it is given)
    cores = placement.available_cores()
    plan = placement.plan(cfg.launch.placement, cfg.launch.num_learner_ranks, cfg.launch.num_local_actors, cores)
    print(f"asyncvla: {placement.summary(plan, cores)}", flush=True)
    learner = children.start("learner", learner_command(cfg, resolved))
    control = f"tcp://{_connect_host(cfg)}:{cfg.transport.control_port}"
    keys = cfg.transport.keys_dir

    def start_actor(i: int) -> subprocess.Popen:
        env = {placement.CORES_ENV: ",".join(map(str, plan.actors[i]))} if plan.pin_actors else {}
        return children.start(f"actor-{i}", actor_command(control, i, keys), env)

    actors = {i: start_actor(i) for i in range(cfg.launch.num_local_actors)}
    restarts = {i: 0 for i in actors}
    evaluator = Evaluator(lambda: children.start("evaluator", evaluator_command(control, run_dir, keys))) \
        if cfg.eval.eval_interval else None
    if fleet is not None:
        fleet.start()
    print(f"asyncvla: run dir {run_dir}; tensorboard --logdir {run_dir / 'tb'}", flush=True)
    fleet_gone_at, local_lost, told_remote = None, False, False
    try:
        while learner.poll() is None and not stop.count:
            time.sleep(0.5)
            if fleet is not None and not fleet.poll() and not actors:
                # (the fleet also ends when a finished learner tells the actors: give it time to exit)
                fleet_gone_at = fleet_gone_at or time.time()
                if time.time() - fleet_gone_at > FLEET_GONE_S:
                    print("asyncvla: every actor host has ended and no local actor runs; stopping the run",
                          file=sys.stderr, flush=True)
                    ended = end_learner(cfg, learner, children, stop, stop_grace_s)
                    print(f"asyncvla: {resume_hint(run_dir) if ended else KILLED_HINT.format(run_dir=run_dir)}",
                          file=sys.stderr, flush=True)
                    return 1
            if evaluator is not None and not stop.count:
                evaluator.check()
            for i, proc in list(actors.items()):
                code = proc.poll()
                if code is None or stop.count:
                    continue
                if code == 0:        # told by the learner that training is over
                    del actors[i]
                    continue
                why = f"actor {i} {exit_reason(code)}"
                if cfg.launch.restart_actors and restarts[i] < cfg.launch.max_actor_restarts:
                    restarts[i] += 1
                    print(f"asyncvla: {why}; restart {restarts[i]}/{cfg.launch.max_actor_restarts}",
                          file=sys.stderr, flush=True)
                    actors[i] = start_actor(i)
                    continue
                del actors[i]
                local_lost = True
                limit = (f"launch.max_actor_restarts={cfg.launch.max_actor_restarts} used up" if cfg.launch.restart_actors
                         else "launch.restart_actors=false")
                print(f"asyncvla: {why}; not restarted ({limit})", file=sys.stderr, flush=True)
            if local_lost and not actors and not stop.count and not (fleet and fleet.poll()):
                remote = remote_actors(run_dir)
                if not remote:             # nothing left to feed the learner
                    print("asyncvla: every local actor has ended, no actor fleet runs and no remote actor is "
                          "registered; stopping the run (see the actor errors above)", file=sys.stderr, flush=True)
                    # (its final checkpoint first: the last words name what the learner recorded)
                    ended = end_learner(cfg, learner, children, stop, stop_grace_s)
                    print(f"asyncvla: {resume_hint(run_dir) if ended else KILLED_HINT.format(run_dir=run_dir)}",
                          file=sys.stderr, flush=True)
                    return 1
                if not told_remote:
                    told_remote = True
                    print(f"asyncvla: every local actor has ended; {len(remote)} remote actor(s) registered "
                          f"({', '.join(remote[:3])}{', ...' if len(remote) > 3 else ''}): training goes on, and "
                          "stops once none is left", file=sys.stderr, flush=True)
        if stop.count:
            return stop_learner(cfg, run_dir, learner, list(actors.values()), evaluator, children, stop,
                                stop_grace_s)
        if learner.returncode != 0:
            print(f"asyncvla: the learner {exit_reason(learner.returncode)} (see its error above); "
                  f"{resume_hint(run_dir)}", file=sys.stderr, flush=True)
            return 1
        # the learner told the actors it is done: let them finish, and the evaluator its last evaluation
        _wait_all(list(actors.values()), timeout=20.0, stop=stop)
        if fleet is not None:
            fleet.wait(20.0)
        if evaluator is not None:
            _wait_all([evaluator.proc], timeout=cfg.eval.final_eval_timeout_s, stop=stop)
        return finished(run_dir)
    finally:
        if fleet is not None:
            fleet.stop()
        children.stop_all()


def stop_learner(cfg: Config, run_dir: Path, learner, actors: list, evaluator, children, stop,
                 grace_s: float) -> int:
    """A user's stop: SIGTERM to each learner rank (the ranks agree on an update boundary, save
    and send the actors "shutdown"), the evaluator stopped at once. Kills the run on a second
    request or when the learner is still running after `grace_s`."""
    if cfg.launch.hostfile:
        print("asyncvla: stopping; the learner ranks of a --hostfile run are out of reach here, so no final "
              f"checkpoint: resume from the last periodic one with --resume {run_dir}", file=sys.stderr, flush=True)
        return 1
    print(f"asyncvla: stopping: the learner finishes its update and saves (up to {grace_s:g} s; "
          "Ctrl-C again to kill the run now)", file=sys.stderr, flush=True)
    if evaluator is not None:
        _signal_group(evaluator.proc, signal.SIGTERM)
    if not end_learner(cfg, learner, children, stop, grace_s, count=1):
        return 1
    if learner.returncode != 0:
        print(f"asyncvla: the learner {exit_reason(learner.returncode)} while stopping; {resume_hint(run_dir)}",
              file=sys.stderr, flush=True)
        return 1
    _wait_all(actors, timeout=20.0, stop=stop)        # they end on the learner's "shutdown"
    end, name = read_end(run_dir), signal.Signals(stop.first).name
    if end is None:
        print(f"asyncvla: stopped by {name}, but the learner left no end record; {resume_hint(run_dir)}",
              file=sys.stderr, flush=True)
        return 1
    where = f"at update {end['step']}" if end["step"] else "before the first update"
    if end["checkpoint"] is None:
        print(f"asyncvla: stopped by {name} {where}: no checkpoint to resume from", flush=True)
    else:
        print(f"asyncvla: stopped by {name} {where}; final checkpoint {end['checkpoint']}; it holds step "
              f"{end['checkpoint_step']}; to continue, run the same command with --resume {run_dir}", flush=True)
    return 128 + stop.first


KILLED_HINT = "resume from its last complete checkpoint with --resume {run_dir}"


def end_learner(cfg: Config, learner, children, stop, grace_s: float, count: int | None = None) -> bool:
    """Ask the learner ranks to stop (SIGTERM: they finish their update, save, tell the actors and
    write their end record) and wait until the learner has exited: True. Kills the run instead
    (False, after one line) on a further stop request (beyond `count`, the requests so far), or
    when the learner is still running `grace_s` after its last rank was asked. A rank still
    importing is asked only once it catches the signal (it would die of it before): its start-up,
    slow on a busy machine, is not part of the grace, and is bounded by STARTING_S instead."""
    count = stop.count if count is None else count
    ranks = 0 if cfg.launch.hostfile else cfg.launch.num_learner_ranks     # (remote ranks: out of reach)
    t_stop, asked = time.time(), set()
    deadline = t_stop + grace_s
    while learner.poll() is None:
        starting = len(asked) < ranks
        if stop.count > count or time.time() > (t_stop + max(grace_s, STARTING_S) if starting else deadline):
            why = ("a second stop request" if stop.count > count else
                   f"a learner rank still starting {max(grace_s, STARTING_S):g} s after the stop" if starting else
                   f"the learner still running after {grace_s:g} s")
            print(f"asyncvla: {why}: killing the run; {KILLED_HINT.format(run_dir=run_dir_of_config(cfg))}",
                  file=sys.stderr, flush=True)
            children.kill_all()
            return False
        for pid in set(learner_ranks(learner.pid)) - asked:
            if catches(pid, signal.SIGTERM):
                _signal_pid(pid, signal.SIGTERM)
                asked.add(pid)
                deadline = time.time() + grace_s
        time.sleep(0.2)
    return True


def finished(run_dir: Path) -> int:
    """The exit code of a learner that exited 0, from its end record: 0 only for a run that ended
    by its budget; a learner stopped by a signal that did not come through this launcher (e.g.
    one sent to its ranks by a scheduler) gives 128 + that signal."""
    end = read_end(run_dir)
    if end is None:
        print(f"asyncvla: the learner exited without its end record ({run_dir / 'learner_end.json'}): "
              f"whether it finished is unknown; {resume_hint(run_dir)}", file=sys.stderr, flush=True)
        return 1
    saved = f"final checkpoint {end['checkpoint']} (step {end['checkpoint_step']})" if end["checkpoint"] \
        else "no checkpoint"
    if end["reason"] == "budget":
        print(f"asyncvla: finished by its budget at update {end['step']}; {saved}", flush=True)
        return 0
    signum = end.get("signal") if isinstance(end.get("signal"), int) else signal.SIGTERM
    print(f"asyncvla: the learner was stopped by {signal.Signals(signum).name} at update {end['step']} "
          f"(not by this launcher); {saved}; to continue, run the same command with --resume {run_dir}",
          file=sys.stderr, flush=True)
    return 128 + signum


def remote_actors(run_dir: Path) -> list[str]:
    """The actors registered with the learner that this launcher did not start (RUN/actors.json,
    kept by the learner's rank 0; nothing before it is written)."""
    return [a for a in read_actors(run_dir) or () if not a.startswith(("local-", EVALUATOR_PREFIX))]


def exit_reason(code: int) -> str:
    """'exited with 1', 'exited with 143 (SIGTERM)', 'exited with -9 (SIGKILL)', and 'exited with
    247 (SIGKILL)' (the deepspeed launcher passes a rank's -9 on as an unsigned byte)."""
    number = -code if code < 0 else 256 - code if code > 192 else code - 128 if code > 128 else None
    try:
        return f"exited with {code}" + (f" ({signal.Signals(number).name})" if number else "")
    except ValueError:
        return f"exited with {code}"


class Evaluator:
    """The periodic evaluator: one that dies while the learner trains is reported and restarted
    EVALUATOR_RESTARTS times; after that evaluation stops, and the launcher says so."""

    def __init__(self, start):
        self.start, self.restarts = start, 0
        self.proc = start()
        self.stopped = False

    def check(self) -> None:
        code = self.proc.poll()                  # (also reaps it: no zombie)
        if code is None or code == 0 or self.stopped:
            return                               # (0: it evaluated the last weights of a finished run)
        if self.restarts < EVALUATOR_RESTARTS:
            self.restarts += 1
            print(f"asyncvla: the evaluator {exit_reason(code)}; restarting it ({self.restarts}/"
                  f"{EVALUATOR_RESTARTS})", file=sys.stderr, flush=True)
            self.proc = self.start()
        else:
            self.stopped = True
            print(f"asyncvla: the evaluator {exit_reason(code)} again; periodic evaluation stops for this run "
                  "(training goes on; `asyncvla eval` evaluates a checkpoint)", file=sys.stderr, flush=True)


def actor_fleet(cfg: Config, run_dir: Path, join_secret: str | None = None):
    """launch.actor_hostfile's fleets (launch/fleet.py), not started yet, or None. With CURVE keys
    each host gets a client bundle of transport.keys_dir: missing ones are made here, before the
    learner starts (it reads its authorized clients once)."""
    if not cfg.launch.actor_hostfile:
        return None
    from asyncvla.launch.fleet import Fleet, read_hostfile
    return Fleet(read_hostfile(cfg.launch.actor_hostfile), f"tcp://{_fleet_host(cfg)}:{cfg.transport.control_port}",
                 run_dir, cfg.transport.keys_dir, cfg.launch.max_actor_restarts if cfg.launch.restart_actors else 0,
                 str(cfg.launch.placement.actors), make_missing_keys=True, join_secret=join_secret)


def _fleet_host(cfg: Config) -> str:
    """The learner's address as other hosts reach it."""
    host = cfg.transport.advertise_host or cfg.transport.bind_host
    return socket.gethostname() if host in ("0.0.0.0", "*") else host


def newest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """(path, step) of the run's newest complete checkpoint, the step read from its completion
    marker (what a resume continues from, not where the run stopped), or None."""
    from asyncvla.learner.checkpoint import find_latest, read_marker    # (torch: imported only when needed)
    latest = find_latest(run_dir)
    return None if latest is None else (latest, int(read_marker(latest)["step"]))


def resume_hint(run_dir: Path) -> str:
    """Where to continue, as the learner recorded it (RUN/learner_end.json; call it once the
    learner has exited): the checkpoint holding its branch's newest step, or after a checkpoint it
    refused to load, the earlier one it named instead; `--resume RUN` where that is what RUN
    resolves to, else that checkpoint itself. Only a learner that left no record (killed before
    it could write one) is answered from the checkpoints on disk, and the line says so."""
    end = read_end(run_dir)
    if end is None:
        latest = newest_checkpoint(run_dir)
        if latest is None:
            return "the learner left no end record, and no complete checkpoint is on disk"
        return (f"the learner left no end record; newest complete checkpoint: {latest[0]}; it holds step "
                f"{latest[1]}; to continue from it: --resume {run_dir}")
    if not end["checkpoint"]:
        return "the learner recorded no checkpoint to resume from"
    tag, latest = Path(end["checkpoint"]), newest_checkpoint(run_dir)
    if latest is not None and latest[0].resolve() == tag.resolve():
        return (f"newest complete checkpoint: {tag}; it holds step {end['checkpoint_step']}; to continue from it: "
                f"--resume {run_dir}")
    return (f"the checkpoint to resume from, as the learner recorded it: {tag}; it holds step "
            f"{end['checkpoint_step']} (a newer one on disk is not on its branch, or was refused); to continue "
            f"from it: --resume {tag}")


def learner_ranks(runner_pid: int) -> list[int]:
    """The learner rank processes under the deepspeed runner (runner -> per-node launcher ->
    ranks), told apart from both launchers, whose command lines name the module too."""
    return [pid for pid in descendants(runner_pid) if python_module(pid) == LEARNER_MODULE]


def learner_command(cfg: Config, resolved_config: Path) -> list[str]:
    ds = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(cfg.launch.master_port)]
    if cfg.launch.hostfile:
        ds += ["--hostfile", cfg.launch.hostfile]
    else:
        # On a CPU machine DeepSpeed counts NUMA nodes as devices; --num_gpus sets the rank count.
        ds += ["--num_gpus", str(cfg.launch.num_learner_ranks)]
    return ds + ["--module", LEARNER_MODULE, str(resolved_config)]


def actor_command(control_endpoint: str, index: int, keys_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", control_endpoint,
           "--actor-id", f"local-{index}", "--actor-index", str(index)]
    return cmd + (["--keys-dir", keys_dir] if keys_dir else [])


def evaluator_command(control_endpoint: str, run_dir: Path, keys_dir: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "asyncvla.launch.evaluator", "--learner", control_endpoint,
           "--run-dir", str(run_dir)]
    return cmd + (["--keys-dir", keys_dir] if keys_dir else [])


def _connect_host(cfg: Config) -> str:
    host = cfg.transport.advertise_host or cfg.transport.bind_host
    return "127.0.0.1" if host in ("0.0.0.0", "*") else host


class Children:
    """Child processes, each in its own session so a stop reaches its whole tree, each sent
    SIGTERM by the kernel if the launcher dies (and every process below told the launcher's pid)."""

    def __init__(self, env: dict | None = None):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = dict(env or {})          # given to every child (the run's join secret)

    def start(self, name: str, cmd: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        me = os.getpid()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(me)}, **self.env, **(extra_env or {}))
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, preexec_fn=lambda: die_with_parent(me))
        self.procs.append((name, proc))
        return proc

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child's process group; SIGKILL what is left of them after grace_s (a
        group outlives its leader while e.g. a rank or an env worker is still closing)."""
        for _, proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(_group_alive(proc) for _, proc in self.procs):
            time.sleep(0.1)
        self.kill_all()

    def kill_all(self) -> None:
        for _, proc in self.procs:
            _signal_group(proc, signal.SIGKILL)


class StopRequests:
    """SIGINT and SIGTERM to the launcher, counted: the first asks for a graceful stop, a second
    for an immediate one; `first` is the first one's number. The handler only counts; the
    launcher's loops act on it."""

    def __init__(self):
        self.count, self.first = 0, None
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.count += 1
        self.first = self.first or signum


def _wait_all(procs: list[subprocess.Popen], timeout: float, stop: StopRequests) -> None:
    """Wait for every process to end, at most `timeout` s; a stop request ends the wait."""
    deadline, count = time.time() + timeout, stop.count
    while time.time() < deadline and stop.count == count and any(p.poll() is None for p in procs):
        time.sleep(0.2)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()                           # reap the leader: a zombie would keep its group alive
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
