"""A SmolVLA from a LeRobot directory trained by asynchronous RL on a ZeRO-3 learner of 2 ranks
(the pixel task, LoRA on its VLM), exported, and acting after export as the checkpoint does.

The directory is the LeRobot-written tiny SmolVLA of tests/golden/smolvla/tiny_a, told the pixel
task's sizes: its action's first 2 of 4 dimensions (the network's tensors are max_action_dim wide
whatever the action) and no state (a zero state token: LeRobot's own processor would want one,
asyncvla's policy does not)."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from asyncvla.common.policy import load_policy
from asyncvla.common.policy.smolvla import SmolVLA
from tests.support.paths import PIXEL
from tests.support.ports import run_port_overrides
from tests.test_smolvla import copy_case


def pixel_task_smolvla(tmp_path):
    d = copy_case(tmp_path, "tiny_a")
    config = json.loads((d / "config.json").read_text())
    config["input_features"].pop("observation.state")
    config["output_features"]["action"]["shape"] = [2]
    (d / "config.json").write_text(json.dumps(config))
    for name in ("policy_preprocessor_step_5_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        stats = load_file(str(d / name))
        save_file({k: v[:2].contiguous() for k, v in stats.items() if k.startswith("action.")}, str(d / name))
    return d


def test_async_rl_on_two_zero3_ranks_then_export(tmp_path):
    """`asyncvla pipeline` (make train) from the directory: no demonstrations, no SFT, RL on 2 ZeRO-3
    ranks, and a summary that sets the loaded policy against RL's on the same episodes."""
    import subprocess
    import sys

    from asyncvla.learner.export import export_policy, load_checkpoint

    source = pixel_task_smolvla(tmp_path)
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "pipeline", str(PIXEL),
                        f"logging.output_dir={tmp_path}", "logging.experiment_name=rl", "logging.progress=false",
                        *run_port_overrides(),
                        f"policy.pretrained_path={source}", "policy.max_instruction_tokens=48",
                        "policy.is_lora=true", "policy.lora_rank=4",            # (LoRA on the VLM's text model)
                        "launch.num_learner_ranks=2", "launch.num_local_actors=2", "learner.max_steps=2",
                        "learner.batch_trajectories=8", "actor.num_envs=4", "actor.rollout_length=4",
                        "algorithm.update_epochs=1", "algorithm.num_minibatches=1", "learner.micro_batch_size=16",
                        "learner.zero_stage=3", "eval.eval_interval=0", "eval.num_episodes=8",
                        "checkpoint.save_interval=2"], capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "finished at step 2" in out and "invalid 0" in out, out[-4000:]
    assert "demonstrations and SFT: none" in out and not (tmp_path / "rl" / "demos").exists(), out[-4000:]
    summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
    assert summary["episodes"] == 8 and summary["loaded"]["path"] == str(source) and summary["rl"]["updates"] == 2
    assert "as loaded:" in out and "after RL (2 updates):" in out, out[-2000:]

    export_policy(tmp_path / "rl", tmp_path / "exported")
    exported = load_policy(tmp_path / "exported")
    trained, _, _ = load_checkpoint(tmp_path / "rl")
    assert type(exported).__name__ == "SmolVLAPolicy" and (tmp_path / "exported" / "lerobot" / "model.safetensors").is_file()
    image = np.random.default_rng(0).integers(0, 255, (2, 64, 64, 3), dtype=np.uint8)
    ids, mask = exported.tokenize(["reach the dot"] * 2)
    a = exported.act(image, ids, mask, None, generator=torch.Generator().manual_seed(1))
    b = trained.act(image, ids, mask, None, generator=torch.Generator().manual_seed(1))
    assert np.allclose(a.actions, b.actions, atol=1e-5) and np.allclose(a.values, b.values, atol=1e-5)
    # In LeRobot's format (`asyncvla export --format lerobot`): LeRobot's denoising of the trained tensors
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "export", str(tmp_path / "rl"), "--out",
                        str(tmp_path / "lerobot"), "--format", "lerobot"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    vla = SmolVLA.load(tmp_path / "lerobot")
    noise = torch.randn((2, 8, 16), generator=torch.Generator().manual_seed(2))
    lerobot = vla.act_chunk({"observation.images.cam": image}, np.zeros((2, 0), np.float32),
                            *vla.tokenize(["reach the dot"] * 2), noise)
    greedy = trained.act(image, ids, mask, None, greedy=True, generator=torch.Generator().manual_seed(2))
    assert np.allclose(lerobot[:, :greedy.actions.shape[1]], greedy.actions, atol=1e-4)
    # RL moved the expert and, through LoRA merged into them, the VLM's attention projections only
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "exported" / "lerobot" / "model.safetensors"))
    assert set(before) == set(after)
    text = "model.vlm_with_expert.vlm.model.text_model.layers.0"
    for name, moved in (("model.action_out_proj.weight", True), (f"{text}.self_attn.q_proj.weight", True),
                        (f"{text}.mlp.up_proj.weight", False)):
        assert torch.equal(before[name].float(), after[name].float()) != moved, name


def test_a_directory_that_does_not_fit_stops_the_run_in_one_line_before_any_process_starts(tmp_path):
    """Wrong type, a missing tensor, an action size other than the env's, missing normaliser
    statistics: each one line naming the key, the tensor or the file (launch/preflight.py); the
    launcher exits 2 with it."""
    import subprocess
    import sys

    from asyncvla.common.config import load_config
    from asyncvla.launch import preflight

    def problems(d):
        return preflight.problems(load_config(str(PIXEL), [f"policy.pretrained_path={d}",
                                                           "policy.max_instruction_tokens=48"]), ports=False)

    assert problems(pixel_task_smolvla(tmp_path / "ok")) == []
    broken = {}
    d = broken["type"] = pixel_task_smolvla(tmp_path / "type")
    (d / "config.json").write_text((d / "config.json").read_text().replace('"smolvla"', '"act"'))
    d = broken["tensor"] = pixel_task_smolvla(tmp_path / "tensor")
    weights = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "model.action_out_proj.bias"}, str(d / "model.safetensors"))
    d = broken["action"] = copy_case(tmp_path / "action", "tiny_a")      # (its 4-D action, the pixel task's 2)
    config = json.loads((d / "config.json").read_text())
    config["input_features"].pop("observation.state")
    (d / "config.json").write_text(json.dumps(config))
    d = broken["stats"] = pixel_task_smolvla(tmp_path / "stats")
    (d / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    words = {"type": ["'act'", "smolvla"], "tensor": ["model.action_out_proj.bias", "missing"],
             "action": ["policy.action_dim=2", "4 dimensions"],
             "stats": ["policy_postprocessor_step_0_unnormalizer_processor.safetensors"]}
    for case, d in broken.items():
        found = problems(d)
        assert len(found) == 1 and found[0].startswith("policy.pretrained_path=") and "\n" not in found[0], found
        assert all(w in found[0] for w in words[case]), (case, found)

    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", str(PIXEL),
                        f"policy.pretrained_path={broken['type']}", f"logging.output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "'act'" in r.stderr, r.stderr


def pushcube_smolvla(tmp_path):
    """tiny_a told PushCube's sizes in configs/smolvla.yaml: a 25-D state (qpos, qvel, TCP pose), so
    max_state_dim 32 and a state projection that wide (its first 16 columns tiny_a's), and
    statistics for 25 dimensions."""
    d = copy_case(tmp_path, "tiny_a")
    config = json.loads((d / "config.json").read_text())
    config["input_features"]["observation.state"]["shape"] = [25]
    config["max_state_dim"] = 32
    (d / "config.json").write_text(json.dumps(config))
    weights = load_file(str(d / "model.safetensors"))
    w = weights["model.state_proj.weight"]
    weights["model.state_proj.weight"] = torch.cat([w, torch.zeros(w.shape[0], 16, dtype=w.dtype)], 1)
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    for name in ("policy_preprocessor_step_5_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        stats = load_file(str(d / name))
        for k in [k for k in stats if k.startswith("observation.state.")]:
            stats[k] = stats[k].repeat(3)[:25].contiguous()
        save_file(stats, str(d / name))
    return d


def test_configs_smolvla_yaml_takes_a_pushcube_shaped_directory_and_names_what_does_not_fit(tmp_path):
    """`make train CONFIG=configs/smolvla.yaml ARGS="policy.pretrained_path=DIR"`: a directory of
    PushCube's sizes passes every check made before a process starts; tiny_a as written (a 9-D
    state) is refused by the key, the run's value and the directory's."""
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import starts_trained
    from asyncvla.launch import preflight
    from tests.support.paths import REPO

    def problems(d):
        return preflight.problems(load_config(str(REPO / "configs" / "smolvla.yaml"),
                                              [f"policy.pretrained_path={d}"]), ports=False)

    good = pushcube_smolvla(tmp_path / "ok")
    assert problems(good) == [] and starts_trained(str(good))
    [line] = problems(copy_case(tmp_path / "as_written", "tiny_a"))
    assert "policy.state_dim=25" in line and "observation.state has 9" in line, line
    policy = load_policy_for(good)
    image = np.zeros((2, 64, 64, 3), np.uint8)
    ids, mask = policy.tokenize(["push the cube to the goal"] * 2)
    out = policy.act(image, ids, mask, np.zeros((2, 25), np.float32), generator=torch.Generator().manual_seed(0))
    assert out.actions.shape == (2, 4, 4) and np.isfinite(out.actions).all()


def load_policy_for(d):
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import build_policy
    from tests.support.paths import REPO
    return build_policy(load_config(str(REPO / "configs" / "smolvla.yaml"), [f"policy.pretrained_path={d}"]).policy)
