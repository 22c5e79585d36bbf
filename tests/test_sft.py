"""`asyncvla sft` end to end, small: LoRA on the pixel task's policy through the DeepSpeed ZeRO-3
engine; tensorboard sft/*, checkpoints and a rerun that continues, a policy directory that
from_pretrained, `asyncvla eval` and `asyncvla export` take."""

import json
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncvla.actors.collect import collect_demos, env_info
from asyncvla.common.config import ConfigError, load_config
from asyncvla.common.data.demos import write_demos
from asyncvla.common.policy import VLAPolicy
from asyncvla.learner.sft import engine_spec
from tests.support.paths import PIXEL

LORA = ["policy.is_lora=true", "policy.lora_rank=4"]


def sft(tmp_path, demos, steps, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "asyncvla.launch.cli", "sft", str(PIXEL), f"sft.data={demos}", f"sft.steps={steps}",
         "sft.save_interval=2", "sft.eval_interval=2", "sft.eval_episodes=4", "sft.batch_size=16",
         "sft.val_fraction=0.25", f"logging.output_dir={tmp_path}", "logging.experiment_name=s", *LORA, *overrides],
        capture_output=True, text=True, timeout=300)


def test_sft_trains_logs_resumes_and_writes_a_policy_eval_and_export_take(tmp_path):
    cfg = load_config(str(PIXEL), LORA)
    episodes, _ = collect_demos(cfg, num_episodes=8, action_noise=0.2, seed=5, num_envs=8)
    write_demos(tmp_path / "demos", episodes, env_info(cfg))

    # (the RL learner's lr decay must not reach SFT: sft/lr stays sft.lr)
    r = sft(tmp_path, tmp_path / "demos", 4, "sft.lr=0.002", "learner.lr_decay_style=linear",
            "learner.lr_decay_iters=2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = tmp_path / "s" / "sft"
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("sft/train_loss", "sft/train_token_accuracy", "sft/train_value_loss", "sft/val_loss",
                "sft/val_token_accuracy", "sft/val_explained_variance", "sft/success_rate"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("sft/val_loss")] == [2, 4]
    assert [(e.step, round(e.value, 9)) for e in acc.Scalars("sft/lr")] == [(s, 0.002) for s in (1, 2, 3, 4)]
    assert (run / "checkpoints" / "step_00000004" / "COMPLETE.json").exists()

    # The policy changed, only where LoRA and the heads are, and loads on its own.
    trained, init = VLAPolicy.from_pretrained(run / "policy"), VLAPolicy.from_pretrained(run / "policy_init")
    a, b = trained.trainable_state_dict(), init.trainable_state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if ".lora_" in k)
    assert trained.cfg.is_lora and (run / "policy" / "config.yaml").exists()

    # A rerun with more steps continues from the checkpoint and keeps the evaluation history.
    r = sft(tmp_path, tmp_path / "demos", steps=6)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "continuing SFT from" in r.stderr and "(step 4)" in r.stderr
    history = json.loads((run / "summary.json").read_text())["history"]
    assert [h["step"] for h in history] == [2, 4, 6]

    cli = [sys.executable, "-m", "asyncvla.launch.cli"]
    ev = subprocess.run(cli + ["eval", str(run / "policy"), "--episodes", "2", "--out", str(tmp_path / "e.json")],
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads((tmp_path / "e.json").read_text())["num_episodes"] == 2
    ex = subprocess.run(cli + ["export", str(run), "--out", str(tmp_path / "x")], capture_output=True, text=True,
                        timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    exported = VLAPolicy.from_pretrained(tmp_path / "x")
    image = episodes[0].images[:2]
    ids, mask = exported.tokenize([episodes[0].instruction] * 2)
    final = VLAPolicy.from_pretrained(run / "policy")
    same = exported.act(image, ids, mask, greedy=True).replay["action_tokens"] == final.act(image, ids, mask, greedy=True).replay["action_tokens"]
    assert same.all()


def test_sft_engine_takes_its_own_zero_stage_and_micro_batch_else_the_learners():
    plain = engine_spec(load_config(str(PIXEL), ["learner.zero_stage=3", "learner.micro_batch_size=32",
                                                 "sft.lr=0.002"]))
    assert (plain.zero_stage, plain.micro_batch_size, plain.lr) == (3, 32, 0.002)
    own = engine_spec(load_config(str(PIXEL), ["learner.zero_stage=3", "learner.micro_batch_size=32",
                                               "sft.zero_stage=0", "sft.micro_batch_size=64"]))
    assert (own.zero_stage, own.micro_batch_size) == (0, 64)
    with pytest.raises(ConfigError, match="sft.zero_stage=4"):
        load_config(str(PIXEL), ["sft.zero_stage=4"])


# Every learner.* key that shapes the RL optimiser or its schedule, at a value other than its default.
RL_OPTIMISER_KEYS = ["learner.lr=0.03", "learner.value_lr=0.04", "learner.adam_beta1=0.5", "learner.adam_beta2=0.9",
                     "learner.adam_eps=0.01", "learner.weight_decay=0.1", "learner.clip_grad=0.25",
                     "learner.lr_warmup_steps=7", "learner.critic_warmup_steps=5", "learner.lr_decay_style=linear",
                     "learner.lr_decay_iters=2", "learner.min_lr=0.0001", "learner.max_steps=3",
                     "algorithm.update_epochs=3", "algorithm.num_minibatches=5"]


def sft_optimiser(overrides: list[str]) -> tuple[dict, list]:
    """The DeepSpeed config SFT's engine gets, and its lr per group over 50 optimizer steps."""
    from asyncvla.learner import engine as ds_engine
    spec = engine_spec(load_config(str(PIXEL), ["sft.lr=0.002", "sft.value_lr=0.003", *overrides]))
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": spec.lr, "name": "policy"},
              {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": spec.value_lr, "name": "value_head"}]
    opt = torch.optim.SGD(groups, lr=1.0)
    sched = ds_engine.lr_schedule(spec)(opt)
    lrs = []
    for _ in range(50):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return ds_engine.build_ds_config(spec, world_size=2, gradient_accumulation_steps=2), lrs


def test_no_learner_optimiser_or_schedule_key_changes_sft():
    """SFT's optimiser and schedule come from sft.* alone: constant sft.lr and sft.value_lr, whatever
    learner.* says about the RL run's optimiser, warm-ups or decay."""
    base_config, base_lrs = sft_optimiser([])
    assert base_lrs == [[0.002, 0.003]] * 50
    for key in RL_OPTIMISER_KEYS:
        ds_config, lrs = sft_optimiser([key])
        assert (ds_config, lrs) == (base_config, base_lrs), key
    ds_config, lrs = sft_optimiser(RL_OPTIMISER_KEYS)
    assert (ds_config, lrs) == (base_config, base_lrs)


def test_an_evaluation_record_with_tasks_logs_each_tasks_success_to_tensorboard(tmp_path):
    """A multi-task SFT evaluation's record holds a dict per task: tensorboard gets one scalar per
    task beside the pooled ones (a dict handed to SummaryWriter as it is raises)."""
    from asyncvla.common.trackers import Trackers, _TensorBoard
    from asyncvla.learner.sft import record_scalars
    record = {"step": 10, "wall_s": 3.0, "val_loss": 0.5, "val_token_accuracy": None, "success_rate": 0.5,
              "tasks": {"PushCube-v1": {"success_rate": 0.75, "ci95": [0.5, 0.9]},
                        "PickCube-v1": {"success_rate": 0.25, "ci95": [0.1, 0.5]}}}
    scalars = record_scalars(record)
    assert scalars == {"sft/val_loss": 0.5, "sft/success_rate": 0.5,
                       "sft/success_rate/PushCube-v1": 0.75, "sft/success_rate/PickCube-v1": 0.25}
    writer = Trackers([_TensorBoard(tmp_path)])
    writer.add_scalars(scalars, 10)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Scalars("sft/success_rate/PickCube-v1")[0].value == 0.25
