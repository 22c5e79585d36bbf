"""The learner's starvation watch and its wait for learner.min_actors (learner/starvation.py) on a
fake clock, and the launcher's
account of how a child ended (launch/train.py exit_reason, common/signals.py catches)."""

import signal
import subprocess
import sys
import time

from asyncvla.common.rundir import read_actors
from asyncvla.common.signals import catches
from asyncvla.launch.train import exit_reason, remote_actors
from asyncvla.learner.starvation import Roster, StarvationWatch, wait_for_actors


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Joining:
    """A registry that actors join as the clock goes on (at `arrivals`: time -> id); its stop
    flag's wait advances the clock, and `stop_at` sets it."""

    def __init__(self, clock, arrivals, stop_at=None):
        self.clock, self.arrivals, self.stop_at, self.waits = clock, arrivals, stop_at, 0

    def actor_ids(self):
        return sorted(a for t, a in self.arrivals.items() if t <= self.clock.t)

    def is_set(self):
        return self.stop_at is not None and self.clock.t >= self.stop_at

    def wait(self, seconds):
        self.waits += 1
        self.clock.t += seconds


def test_the_learner_waits_for_min_actors_and_the_evaluator_does_not_count(caplog):
    clock = Clock()
    registry = Joining(clock, {clock.t: "evaluator-vm-7", clock.t + 1: "host-a-0", clock.t + 45: "host-b-0"})
    with caplog.at_level("INFO", logger="asyncvla.learner"):
        joined = wait_for_actors(2, registry.actor_ids, registry, repeat_s=30, poll_s=1, clock=clock)
    assert joined == 2 and clock.t == 1045                 # not at 1001, when the evaluator and one actor were in
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "waiting for 2 actors to join before the first update (learner.min_actors); 0 so far"
    assert said[1] == "still waiting for actors: 1 of learner.min_actors=2 joined after 30 s: host-a-0"
    assert said[2] == "2 actors joined after 45 s; training starts" and len(said) == 3

    # enough already: no wait, no line; a stop ends the wait with the count so far
    assert wait_for_actors(1, registry.actor_ids, registry, clock=clock) == 2 and registry.waits == 45
    stopping = Joining(clock, {clock.t: "host-a-0"}, stop_at=clock.t + 5)
    assert wait_for_actors(3, stopping.actor_ids, stopping, poll_s=1, clock=clock) == 1 and stopping.waits == 5

    # the starvation watch counts its silence from the end of the wait, not from before it
    watch = StarvationWatch(60.0, rank=0, clock=clock)
    clock.t += 100
    watch.restart()
    assert watch.check() is None
    clock.t += 61
    assert "no segment for 61 s" in watch.check()


def test_one_line_per_interval_of_silence_naming_the_actors_last_heard_from():
    clock = Clock()
    watch = StarvationWatch(60.0, rank=0, registry=lambda: {"alive": 1}, clock=clock)
    clock.t += 59
    assert watch.check() is None                          # not yet silent for the timeout
    clock.t += 2
    line = watch.check()
    assert "rank 0: no segment for 61 s" in line and "no actor has sent one yet" in line
    assert "1 actor(s) registered" in line
    assert watch.check() is None                          # one line per interval, not per call
    watch.fed("local-0")
    clock.t += 10
    watch.fed("local-1")
    clock.t += 30
    assert watch.check() is None                          # a segment restarts the interval
    clock.t += 31
    line = watch.check()
    assert "no segment for 61 s" in line
    assert line.index("local-1 (61 s ago)") < line.index("local-0 (71 s ago)")   # the newest first
    clock.t += 60
    assert "no segment for 121 s" in watch.check()
    assert watch.lines == 3


def test_a_watch_with_timeout_zero_never_speaks_and_names_at_most_five_actors():
    clock = Clock()
    off = StarvationWatch(0.0, rank=1, clock=clock)
    clock.t += 1e6
    assert off.check() is None
    watch = StarvationWatch(5.0, rank=1, clock=clock)
    for i in range(8):
        watch.fed(f"a{i}")
    clock.t += 6
    line = watch.check()
    assert "a7" in line and "a3" in line and "a2" not in line and "and 3 more" in line
    assert "registered" not in line                       # ranks > 0 have no registry


def test_the_roster_tells_the_launcher_which_remote_actors_feed_the_learner(tmp_path):
    """Rank 0 rewrites RUN/actors.json when the registered ids change; the launcher counts those it
    did not start (not local-*, not evaluator-*), and none before the file exists."""
    ids = ["evaluator-h-1", "local-0"]
    roster = Roster(tmp_path, lambda: list(ids))
    assert remote_actors(tmp_path) == []
    roster.update()
    assert read_actors(tmp_path) == ["evaluator-h-1", "local-0"] and remote_actors(tmp_path) == []
    ids.append("node-1-0")
    roster.update()
    assert remote_actors(tmp_path) == ["node-1-0"]
    (tmp_path / "actors.json").write_text("{not json")
    roster.update()                                       # (unchanged ids: not rewritten)
    assert read_actors(tmp_path) is None and remote_actors(tmp_path) == []
    ids.remove("node-1-0")
    roster.update()
    assert remote_actors(tmp_path) == [] and read_actors(tmp_path) == ["evaluator-h-1", "local-0"]


def test_exit_reasons_name_the_signal():
    assert exit_reason(1) == "exited with 1"
    assert exit_reason(143) == "exited with 143 (SIGTERM)"
    assert exit_reason(130) == "exited with 130 (SIGINT)"
    assert exit_reason(-9) == "exited with -9 (SIGKILL)"
    assert exit_reason(247) == "exited with 247 (SIGKILL)"


def test_catches_tells_a_process_with_a_handler_from_one_still_starting():
    code = ("import signal, sys, time; time.sleep(float(sys.argv[1])); "
            "signal.signal(signal.SIGTERM, lambda *a: None); print('ready', flush=True); time.sleep(60)")
    bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handled = subprocess.Popen([sys.executable, "-c", code, "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert handled.stdout.readline().strip() == "ready"
        assert catches(handled.pid, signal.SIGTERM)
        assert not catches(handled.pid, signal.SIGUSR1)
        time.sleep(0.5)                                   # (the bare one is surely past exec by now)
        assert not catches(bare.pid, signal.SIGTERM)
        assert not catches(2 ** 22 + 12345, signal.SIGTERM)   # no such process
    finally:
        for p in (bare, handled):
            p.kill()
            p.wait()
