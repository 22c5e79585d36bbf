"""End to end, the system's promises, on real processes and sockets with a small backbone:

* kill -9 of the learner, then resume: step, version and published weights continue (the
  re-published weights are bit-equal to those published before the kill, which the checkpoint
  holds), and standalone actors that keep running rejoin by themselves;
* a standalone `asyncvla actor` started mid-run joins, contributes segments (visible in the
  metrics) and leaves without disturbing the learner;
* a standalone actor joining a 2-rank learner uses the rollout plan the learner sends;
* two ZeRO-3 learner ranks in --sync mode: with rollout_ema_decay=0 the published tensors equal
  the full tensors consolidated from the sharded checkpoint, and the policy lag is 0.
"""

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from asyncvla.common.transport.auth import ensure_join_secret, read_join_secret
from asyncvla.common.config import TransportConfig, load_config, to_yaml
from asyncvla.common.transport.control import LearnerClient
from asyncvla.common.transport.weight_channel import WeightSubscriber
from asyncvla.launch.train import learner_command
from asyncvla.learner.checkpoint import read_client_state
from tests.support.paths import PIXEL
from tests.support.runs import complete, latest_complete, scalars, small_run, start, stop, wait_for


def actor_cmd(cfg, actor_id: str, run: Path) -> list[str]:
    """A standalone actor on the learner's machine: it joins with the run's secret (--run-dir)."""
    return [sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner",
            f"tcp://127.0.0.1:{cfg.transport.control_port}", "--actor-id", actor_id, "--num-envs", "2",
            "--run-dir", str(run)]


class VersionWatcher:
    """A weight subscriber in a thread that keeps every version it receives, in arrival order
    (a version published while an older one is in flight may be skipped: only the newest is served).
    It joins the learner as an actor that sends nothing (only registered actors get weights), and
    rejoins a restarted one by itself."""

    def __init__(self, cfg, run: Path):
        tcfg = TransportConfig(reconnect_max_s=0.5)     # back soon after a learner restart
        self.client = LearnerClient(f"tcp://127.0.0.1:{cfg.transport.control_port}", "version-watcher", tcfg,
                                    join_secret=read_join_secret(run))
        self.client.join(timeout=0)           # says hello from now on; the subscriber asks once welcomed
        self.sub = WeightSubscriber(f"tcp://127.0.0.1:{cfg.transport.weights_port}", tcfg,
                                    actor_id="version-watcher", token=lambda: self.client.token)
        self.seen: list[tuple[int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            got = self.sub.wait_newer(-1, timeout=0.2)
            if got is not None:
                self.seen.append((got[0], {k: np.array(v, copy=True) for k, v in got[1].items()}))

    def versions(self) -> list[int]:
        return [v for v, _ in self.seen]

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sub.close()
        self.client.close()


def test_kill9_resume_and_standalone_actors(tmp_path):
    overrides = small_run(tmp_path, "resume", "learner.max_steps=1000", "checkpoint.save_interval=2",
                          "learner.rollout_ema_decay=0.5", "launch.num_local_actors=0")
    cfg = load_config(str(PIXEL), overrides)
    run = tmp_path / "resume"
    run.mkdir()
    (run / "launch_config.yaml").write_text(to_yaml(cfg))
    ensure_join_secret(run)                  # (what `asyncvla train` does before the learner starts)
    learner = start(learner_command(cfg, run / "launch_config.yaml"), tmp_path / "learner1.log")
    actor1 = start(actor_cmd(cfg, "standalone-1", run), tmp_path / "actor1.log")
    actor2 = None
    actor1_paused = False
    watcher = VersionWatcher(cfg, run)
    try:
        # A second standalone actor joins after training began, contributes, then is killed.
        wait_for(lambda: complete(run, 2), 240, "the step-2 checkpoint", [learner, actor1])
        actor2 = start(actor_cmd(cfg, "standalone-2", run), tmp_path / "actor2.log")
        # Wait for the metric, not the actor's "first segment sent": a sent segment may still sit
        # in the learner's queue, and a rank discards what it queues from an actor that has gone.
        wait_for(lambda: max(scalars(run, "system/actors_contributing").values(), default=0) >= 2,
                 180, "the mid-run actor's segments in the learner's metrics", [learner, actor1])
        os.killpg(actor2.pid, signal.SIGKILL)
        actor2.wait()

        # kill -9 the learner once a checkpoint newer than the mid-run join is complete.
        target = latest_complete(run) + 2
        wait_for(lambda: complete(run, target), 240, f"the step-{target} checkpoint", [learner, actor1])
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait()
        saved = latest_complete(run)
        state = read_client_state(run / "checkpoints" / f"step_{saved:08d}")
        assert state["step"] == saved and state["version"] == saved

        # Resume from the run directory with 3 more steps to go; actor 1 keeps running and must
        # rejoin by itself. It is paused (SIGSTOP) until the watcher has the first weights the new
        # learner serves: with data the learner could train past the checkpoint's version before
        # the watcher is welcomed, and only the newest version is served.
        cfg.checkpoint.resume = str(run)
        cfg.learner.max_steps = end = saved + 3
        (run / "resume_config.yaml").write_text(to_yaml(cfg))
        os.killpg(actor1.pid, signal.SIGSTOP)
        actor1_paused = True
        learner = start(learner_command(cfg, run / "resume_config.yaml"), tmp_path / "learner2.log")
        watcher.sub.reset()
        n_before = len(watcher.seen)
        wait_for(lambda: len(watcher.seen) > n_before, 240, "weights after the restart", [learner])
        version, tensors = watcher.seen[n_before]
        assert version == saved, (version, saved)             # the checkpoint's version, re-published
        shadow = state["ema"]["shadow"]                        # ... with the checkpoint's EMA bits
        assert tensors.keys() == shadow.keys()
        for k, v in tensors.items():
            np.testing.assert_array_equal(v, shadow[k].numpy(), err_msg=k)
        os.killpg(actor1.pid, signal.SIGCONT)
        actor1_paused = False

        assert learner.wait(timeout=300) == 0, (tmp_path / "learner2.log").read_text()[-3000:]
        assert actor1.wait(timeout=60) == 0, (tmp_path / "actor1.log").read_text()[-3000:]
    finally:
        if actor1_paused:
            os.killpg(actor1.pid, signal.SIGCONT)
        watcher.close()
        stop(learner, actor1, actor2)

    assert "resumed from" in (tmp_path / "learner2.log").read_text()
    steps = scalars(run, "rollout/version")
    assert max(steps) == end and steps[end] == end, steps           # step and version continued
    assert all(steps[s] == s for s in steps), steps
    assert max(scalars(run, "system/actors_contributing").values()) >= 2
    assert latest_complete(run) == end
    assert "rejoined" in (tmp_path / "actor1.log").read_text().lower()


def test_standalone_actor_takes_its_rollout_plan_from_a_two_rank_learner(tmp_path):
    """The learner works out each actor's share from its ranks, batch and the actor's own envs,
    and sends it in the welcome; the actor derives nothing from the learner's launch settings."""
    from asyncvla.learner.ingest import rollout_plan
    overrides = small_run(tmp_path, "plan", "learner.max_steps=3", "learner.batch_trajectories=8",
                          "launch.num_local_actors=0", "launch.num_learner_ranks=2", "eval.eval_interval=0")
    cfg = load_config(str(PIXEL), overrides)
    run = tmp_path / "plan"
    run.mkdir()
    (run / "launch_config.yaml").write_text(to_yaml(cfg))
    ensure_join_secret(run)
    learner = start(learner_command(cfg, run / "launch_config.yaml"), tmp_path / "learner.log")
    actor = start(actor_cmd(cfg, "standalone", run), tmp_path / "actor.log")      # 2 envs, not the config's 4
    try:
        assert learner.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert actor.wait(timeout=60) == 0, (tmp_path / "actor.log").read_text()[-3000:]
    finally:
        stop(learner, actor)
    plan = rollout_plan(cfg, 2, 2)
    assert plan == {"segments_per_version": 4, "max_segments_in_flight": 4}   # 2 ranks x 4 columns / 2 envs
    assert (f"{plan['segments_per_version']} segments per version, at most "
            f"{plan['max_segments_in_flight']} in flight") in (tmp_path / "actor.log").read_text()
    assert max(scalars(run, "rollout/version").values()) == 3


def test_two_ranks_sync_publish_equals_consolidated_checkpoint(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    # 2 ranks x (2 actors x 4 envs): each rank gets one segment from each actor per version.
    overrides = small_run(tmp_path, "two_ranks", "learner.max_steps=3", "checkpoint.save_interval=1",
                          "learner.batch_trajectories=16", "checkpoint.keep_last=10",
                          "learner.rollout_ema_decay=0.0", "launch.num_local_actors=2")
    cfg_path = PIXEL
    cfg = load_config(str(cfg_path), overrides)
    train = start([sys.executable, "-m", "asyncvla.launch.cli", "train", str(cfg_path), *overrides,
                   "--num-learner-ranks", "2", "--sync"], tmp_path / "train.log")
    watcher = None
    try:
        # Subscribe once the weight server is up (a socket that has been retrying for a while
        # backs off, and the 3 small updates take about a second).
        wait_for(lambda: "actors join at" in (tmp_path / "train.log").read_text(), 300, "the learner", [train])
        watcher = VersionWatcher(cfg, tmp_path / "two_ranks")
        wait_for(lambda: any(v > 0 for v in watcher.versions()), 300, "a trained version", [train])
        assert train.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        if watcher is not None:
            watcher.close()
        stop(train)
    run = tmp_path / "two_ranks"
    version, published = next((v, t) for v, t in watcher.seen if v > 0)
    full = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=f"step_{version:08d}")
    assert published and set(published) <= set(full)
    for k, v in published.items():
        np.testing.assert_array_equal(v, full[k].detach().to(torch.float32).numpy(), err_msg=k)
    lag = scalars(run, "rollout/policy_lag_max")
    assert lag and max(lag.values()) == 0, lag                       # --sync: never off-policy
