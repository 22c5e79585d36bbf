"""Stopping `asyncvla train`, on real processes: a DeepSpeed learner on CPU, a local actor and the
evaluator over loopback.

* A learner without actors says so; Ctrl-C then ends the run with 130 and one line (the other
  stops, Ctrl-C with its final checkpoint and resume included, are rows of the fault suite).
* a learner still running after --stop-grace-s is killed with the whole run.
* SIGKILL to the launcher: within 5 s no process of the run is left — the deepspeed runner and
  its per-node launcher, the learner rank (a grandchild), the actor, the evaluator, and whatever
  they started.
* The two mechanisms behind that, on bare processes: the parent-death signal of a direct child
  and the launcher watch of a grandchild.
"""

import os
import signal
import subprocess
import sys
import time

from asyncvla.common.signals import LAUNCHER_PID_ENV, descendants, process_start_time, python_module
from asyncvla.launch.train import STOP_GRACE_S, learner_ranks
from tests.support.paths import PIXEL
from tests.support.runs import scalars, small_run, start, stop, wait_for


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncvla.launch.cli", "train", str(PIXEL), *args]


def run_overrides(tmp_path, name: str, *extra: str) -> list[str]:
    """A small run with one actor and the evaluator that would go on for hours."""
    return small_run(tmp_path, name, "learner.max_steps=100000", "checkpoint.save_interval=0",
                     "launch.num_local_actors=1", "eval.eval_interval=100000", "eval.num_episodes=2", *extra)


def interrupt(train) -> tuple[int, dict]:
    """Ctrl-C to a running `asyncvla train`: its exit code, and its process tree as it was then
    (what must be gone afterwards)."""
    procs = tree(train.pid)
    train.send_signal(signal.SIGINT)
    return train.wait(timeout=STOP_GRACE_S + 30), procs


def trained(run, steps: int):
    return lambda: (run / "tb").is_dir() and max(scalars(run, "rollout/version").values(), default=0) >= steps


def tree(pid: int) -> dict[int, tuple[int, str | None]]:
    """Every process below `pid`: pid -> (start time, python module)."""
    return {p: (process_start_time(p), python_module(p)) for p in descendants(pid)}


def alive(procs: dict) -> dict:
    return {p: m for p, (t, m) in procs.items() if t is not None and process_start_time(p) == t}


def kill_left(procs: dict) -> None:
    for p in alive(procs):
        os.kill(p, signal.SIGKILL)


def test_a_killed_launcher_leaves_no_process_behind(tmp_path):
    run = tmp_path / "kill"
    train = start(train_cmd(*run_overrides(tmp_path, "kill")), tmp_path / "train.log")
    procs = {}
    try:
        wait_for(trained(run, 1), 240, "an update", [train])
        procs = tree(train.pid)
        modules = [m for _, m in procs.values()]
        for module in ("deepspeed.launcher.runner", "deepspeed.launcher.launch", "asyncvla.learner.main",
                       "asyncvla.launch.cli", "asyncvla.launch.evaluator"):
            assert module in modules, (module, procs)
        runner = next(p for p, (_, m) in procs.items() if m == "deepspeed.launcher.runner")
        assert learner_ranks(runner) == [p for p, (_, m) in procs.items() if m == "asyncvla.learner.main"]
        os.kill(train.pid, signal.SIGKILL)
        train.wait()
        deadline = time.time() + 5.0
        while alive(procs) and time.time() < deadline:
            time.sleep(0.1)
        left = alive(procs)
    finally:
        stop(train)
        kill_left(procs)
    assert not left, (left, (tmp_path / "train.log").read_text()[-3000:])


def test_a_learner_still_busy_after_the_grace_period_is_killed(tmp_path):
    """--stop-grace-s bounds a stop: a learner still running when it is up (here 0.1 s, less than
    an update and a save take) is killed with the rest of the run, and the launcher says so."""
    run, log = tmp_path / "grace", tmp_path / "train.log"
    train = start(train_cmd(*run_overrides(tmp_path, "grace"), "--stop-grace-s", "0.1"), log)
    procs = {}
    try:
        wait_for(trained(run, 1), 240, "an update", [train])
        procs = tree(train.pid)
        t0 = time.time()
        train.send_signal(signal.SIGINT)
        code = train.wait(timeout=60)
        took = time.time() - t0
    finally:
        stop(train)
        kill_left(procs)
    out = log.read_text()
    assert code == 1, out[-4000:]
    assert "the learner still running after 0.1 s: killing the run" in out, out[-4000:]
    assert took < 10, took
    assert not alive(procs), alive(procs)


def test_a_learner_without_actors_says_so_and_ctrl_c_ends_it_with_130_and_one_line(tmp_path):
    """A learner with no actor at all says so while it waits; a Ctrl-C then ends the run as any
    stopped run does, before its first update. (Ctrl-C during start-up, an actor's SIGTERM and
    restart, an evaluator's SIGKILL, a starving learner that names its actor and the launcher's
    SIGINT with its final checkpoint and resume are rows of the fault suite, tests/test_faults.py.)"""
    run, log = tmp_path / "starving", tmp_path / "starving.log"
    overrides = run_overrides(tmp_path, "starving", "launch.num_local_actors=0", "eval.eval_interval=0",
                              "learner.starvation_timeout_s=1")
    train = start(train_cmd(*overrides), log)
    procs = {}
    try:
        wait_for(lambda: "no actor has sent one yet" in log.read_text(), 240, "the starvation line", [train])
        code, procs = interrupt(train)
    finally:
        stop(train)
        kill_left(procs)
    out = log.read_text()
    assert code == 130 and "Traceback" not in out, out[-4000:]
    assert [ln for ln in out.splitlines() if ln.startswith("asyncvla: stopped by")] == \
        ["asyncvla: stopped by SIGINT before the first update: no checkpoint to resume from"]
    assert not alive(procs), alive(procs)


# ------------------------------------------------------------------- the mechanisms, bare
SLEEPER = "import time; time.sleep(60)"
WATCHER = "from asyncvla.common.signals import stop_on_signals; stop_on_signals(); import time; time.sleep(60)"


def test_a_direct_child_gets_the_parent_death_signal(tmp_path):
    """A parent (standing in for the launcher) starts a child with die_with_parent, then is
    SIGKILLed: the child goes at once."""
    parent_code = ("import subprocess, sys, os, time; from asyncvla.common.signals import die_with_parent\n"
                   f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], "
                   "preexec_fn=lambda me=os.getpid(): die_with_parent(me))\n"
                   "print(c.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    started = process_start_time(child)
    try:
        assert started is not None
        parent.kill()
        parent.wait()
        wait_for(lambda: process_start_time(child) != started, 5, "the child to end")
    finally:
        if process_start_time(child) == started:
            os.kill(child, signal.SIGKILL)


def test_a_grandchild_exits_when_the_launcher_is_gone(tmp_path):
    """A process of ours below the launcher's children (as the learner ranks are) watches the
    launcher's pid from LAUNCHER_PID_ENV; without the variable it watches nothing."""
    launcher = subprocess.Popen([sys.executable, "-c", SLEEPER])
    env = dict(os.environ, **{LAUNCHER_PID_ENV: str(launcher.pid)})
    watching = subprocess.Popen([sys.executable, "-c", WATCHER], env=env, stderr=subprocess.PIPE, text=True)
    unrelated = subprocess.Popen([sys.executable, "-c", WATCHER],
                                 env={k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV})
    try:
        time.sleep(3.0)                                   # both imported and watching (or not)
        assert watching.poll() is None and unrelated.poll() is None
        launcher.kill()
        launcher.wait()
        assert watching.wait(timeout=5) == 1
        assert f"the launcher (pid {launcher.pid}) is gone" in watching.stderr.read()
        time.sleep(1.0)
        assert unrelated.poll() is None
    finally:
        for p in (launcher, watching, unrelated):
            p.kill()
            p.wait()


def test_sigterm_to_the_pipeline_exits_143_saying_where_it_stopped(tmp_path):
    """`asyncvla pipeline` passes SIGTERM on to its stage and exits 128 + SIGTERM (143), not 130:
    a scheduler's stop reads as what it was. Here during the demonstrations."""
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "pipeline", str(PIXEL),
           f"logging.output_dir={tmp_path}", "logging.experiment_name=pipe", "collect.num_episodes=1000000"]
    log = tmp_path / "pipeline.log"
    p = start(cmd, log)
    try:
        wait_for(lambda: "collect:" in log.read_text(), 120, "the demos stage collecting", [p])
        p.send_signal(signal.SIGTERM)                    # to the pipeline alone: it passes it on
        p.wait(timeout=120)
    finally:
        stop(p)
    out = log.read_text()
    assert p.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "asyncvla pipeline: interrupted during demonstrations; the same command continues" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
