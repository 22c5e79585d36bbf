"""End to end, small: `asyncvla train` on the pixel task with a DeepSpeed ZeRO-3 learner and a local
actor process over ZeroMQ; it must train, publish, log to tensorboard, checkpoint, evaluate the
published policy and stop by itself."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncvla.learner.checkpoint import read_client_state
from tests.support.runs import train_pixel_task


@pytest.mark.parametrize("head", ["autoregressive", "parallel"])
def test_train_pixel_task_end_to_end(tmp_path, head):
    r = train_pixel_task(tmp_path, "e2e", [f"policy.action_head={head}",
        "learner.max_steps=3", "learner.batch_trajectories=4", "learner.micro_batch_size=16",
        "actor.num_envs=4", "actor.rollout_length=4", "checkpoint.save_interval=2",
        "launch.num_local_actors=1", "algorithm.num_minibatches=1", "algorithm.value_augment_shift=2",
        "eval.eval_interval=2", "eval.num_episodes=2"], timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "e2e"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMPLETE.json").exists())
    assert ckpts == ["step_00000002", "step_00000003"]
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/actor/policy_loss", "train/critic/value_loss", "train/actor/approx_kl",
                "rollout/policy_lag_mean", "time/samples_per_s", "time/learner_idle_s",
                "time/publish_s", "system/actors_alive"):
        assert tag in tags, (tag, sorted(tags))
    steps = [e.step for e in acc.Scalars("train/actor/policy_loss")]
    assert steps == [1, 2, 3]
    versions = [e.value for e in acc.Scalars("rollout/version")]
    assert versions == [1, 2, 3]
    assert json.loads((run / "checkpoints" / "step_00000003" / "COMPLETE.json").read_text())
    # The evaluator process evaluated the published policy at least at the last step.
    summary = json.loads((run / "eval" / "step_00000003" / "summary.json").read_text())
    assert summary["num_episodes"] == 2 and summary["step"] == 3
    assert len(list((run / "eval" / "step_00000003").glob("*.mp4"))) == 2
    assert 3 in [e.step for e in acc.Scalars("eval/success_rate")]


def test_train_stops_when_every_local_actor_has_failed(tmp_path):
    """An actor that cannot start (here: a CUDA device on a CPU-only torch) is restarted up to
    launch.max_actor_restarts times; then the run stops with an error instead of leaving the
    learner waiting for data for ever."""
    r = train_pixel_task(tmp_path, "crash", ["actor.device=cuda:0", "launch.num_local_actors=1",
                                             "launch.max_actor_restarts=1", "eval.eval_interval=0"], timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "actor 0 exited with 1; restart 1/1" in r.stderr
    assert "actor 0 exited with 1; not restarted (launch.max_actor_restarts=1 used up)" in r.stderr
    assert "every local actor has ended, no actor fleet runs and no remote actor is registered; stopping the run" in r.stderr


def test_resume_from_the_checkpoints_folder_with_periodic_eval_ends_by_itself(tmp_path):
    """`--resume RUN/checkpoints` keeps RUN as the run directory for every process: the launcher's
    files, the learner's checkpoints and the evaluator's results all land in RUN, and the run ends.
    The value normalisation's statistics and the seconds trained carry over too."""
    small = ["learner.batch_trajectories=4", "learner.micro_batch_size=16", "actor.num_envs=4",
             "actor.rollout_length=4", "launch.num_local_actors=1", "algorithm.num_minibatches=1",
             "checkpoint.save_interval=1", "algorithm.value_norm=true", "algorithm.value_norm_decay=0.9"]
    first = train_pixel_task(tmp_path, "res", small + ["learner.max_steps=2", "eval.eval_interval=0"], timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "res"
    trained = read_client_state(run / "checkpoints" / "step_00000002")["time_s"]
    assert trained > 0
    again = train_pixel_task(tmp_path, "ignored", small + [
        "learner.max_steps=4", "eval.eval_interval=2", "eval.num_episodes=2",
        "--resume", str(run / "checkpoints")], timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert not (tmp_path / "ignored").exists() and not (run / "checkpoints" / "launch_config.yaml").exists()
    assert "checkpoint:\n" in (run / "launch_config.yaml").read_text()
    # From the weights the resumed learner published, with their steps: step 2's (republished at
    # the start) when the evaluator joined before update 3 was published, else the newest one then
    # (an evaluator that joins late evaluates what is published when it comes); the last one always.
    steps = sorted(int(d.name.split("_")[1]) for d in (run / "eval").glob("step_*"))
    assert steps in ([2, 4], [3, 4], [4]), steps
    for step in steps:
        summary = json.loads((run / "eval" / f"step_{step:08d}" / "summary.json").read_text())
        assert summary["step"] == step
    assert (run / "checkpoints" / "step_00000004" / "COMPLETE.json").exists()
    # 4 updates' worth of statistics (2 saved, 2 after the resume), not 2 of a fresh start
    state = read_client_state(run / "checkpoints" / "step_00000004")
    assert state["value_norm"]["weight"] == pytest.approx(1 - 0.9 ** 4) and state["value_norm"]["sq_acc"] > 0
    assert state["time_s"] > trained                    # the seconds trained count on (learner.max_time_s)

