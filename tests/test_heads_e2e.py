"""The continuous action heads end to end on the pixel task: demos -> SFT (flow matching; the
Gaussian's log-likelihood) -> asynchronous RL on a ZeRO-3 learner of 2 ranks -> export -> the
export acts as the checkpoint does -> asyncvla eval."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from asyncvla.common.policy import VLAPolicy
from tests.support.paths import PIXEL, REPO
from tests.support.ports import run_port_overrides

CLI = [sys.executable, "-m", "asyncvla.launch.cli"]
HEADS = {"flow": ["policy.action_head=flow", "policy.flow.num_steps=3"], "gaussian": ["policy.action_head=gaussian"]}


def run(*args, timeout):
    r = subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos")
    run("collect", str(PIXEL), "collect.num_episodes=16", "--out", str(out), timeout=120)
    return out


@pytest.mark.parametrize("head", list(HEADS))
def test_sft_then_async_rl_on_zero3_then_export_and_eval(tmp_path, demos, head):
    from asyncvla.learner.export import export_policy, load_checkpoint

    run("sft", str(PIXEL), *HEADS[head], f"sft.data={demos}", "sft.steps=20", "sft.eval_episodes=4",
        "learner.zero_stage=0", f"logging.output_dir={tmp_path}", "logging.experiment_name=sft",
        "logging.progress=false", timeout=300)
    sft_policy = tmp_path / "sft" / "sft" / "policy"
    history = json.loads((tmp_path / "sft" / "sft" / "summary.json").read_text())["history"]
    assert history[-1]["val_loss"] is not None and history[-1]["val_token_accuracy"] is None

    out = run("train", str(PIXEL), *HEADS[head], f"policy.pretrained_path={sft_policy}", "launch.num_learner_ranks=2",
              "launch.num_local_actors=2", "learner.max_steps=2", "learner.batch_trajectories=8", "actor.num_envs=4",
              "actor.rollout_length=4", "algorithm.update_epochs=1", "algorithm.num_minibatches=1",
              "learner.micro_batch_size=16", "learner.zero_stage=3", "eval.eval_interval=0",
              "checkpoint.save_interval=2", f"logging.output_dir={tmp_path}", "logging.experiment_name=rl",
              "logging.progress=false", *run_port_overrides(), timeout=400)
    assert "finished at step 2" in out and "invalid 0" in out, out[-4000:]

    export_policy(tmp_path / "rl", tmp_path / "exported")
    exported = VLAPolicy.from_pretrained(str(tmp_path / "exported"))
    trained, _, _ = load_checkpoint(tmp_path / "rl")
    assert exported.cfg.action_head == head
    rng = np.random.default_rng(0)
    size = exported.cfg.image_size
    image = rng.integers(0, 255, (4, size, size, 3), dtype=np.uint8)
    ids, mask = exported.tokenize(["reach the dot"] * 4)
    state = np.zeros((4, exported.cfg.state_dim), np.float32) if exported.cfg.state_dim else None
    for greedy in (True, False):
        a = exported.act(image, ids, mask, state, greedy=greedy, generator=torch.Generator().manual_seed(1))
        b = trained.act(image, ids, mask, state, greedy=greedy, generator=torch.Generator().manual_seed(1))
        assert np.allclose(a.actions, b.actions, atol=1e-5) and np.allclose(a.values, b.values, atol=1e-5)

    report = run("eval", str(tmp_path / "exported"), "--env", "PixelReach-v0", "--episodes", "4", "--greedy",
                 "--out", str(tmp_path / "eval.json"), timeout=120)
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert summary["num_episodes"] == 4 and 0.0 <= summary["success_rate"] <= 1.0, report[-2000:]


def test_grpo_sft_then_async_rl_on_zero3(tmp_path, demos):
    """algorithm.adv_type=grpo end to end: the actors hold segments until their groups of 4
    episodes have ended and send each step's group-relative advantage; 2 ZeRO-3 ranks train on
    them (no critic), every segment valid."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run("sft", str(PIXEL), f"sft.data={demos}", "sft.steps=20", "sft.eval_episodes=4", "learner.zero_stage=0",
        f"logging.output_dir={tmp_path}", "logging.experiment_name=sft", "logging.progress=false", timeout=300)
    out = run("train", str(PIXEL), f"policy.pretrained_path={tmp_path / 'sft' / 'sft' / 'policy'}",
              "algorithm.adv_type=grpo", "algorithm.group_size=4", "env.max_episode_steps=12",
              "launch.num_learner_ranks=2", "launch.num_local_actors=2", "learner.max_steps=3",
              "learner.batch_trajectories=8", "actor.num_envs=4", "actor.rollout_length=4",
              "algorithm.num_minibatches=1", "learner.micro_batch_size=16", "learner.zero_stage=3",
              "eval.eval_interval=0", f"logging.output_dir={tmp_path}", "logging.experiment_name=rl",
              "logging.progress=false", *run_port_overrides(), timeout=400)
    assert "finished at step 3" in out and "invalid 0" in out, out[-4000:]
    acc = EventAccumulator(str(tmp_path / "rl" / "tb"))
    acc.Reload()
    kept = [e.value for e in acc.Scalars("rollout/group_steps_kept")]
    assert len(kept) == 3 and all(0.0 <= k <= 1.0 for k in kept) and max(kept) > 0, kept
