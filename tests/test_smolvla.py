"""asyncvla's own SmolVLA against LeRobot's: the golden outputs in tests/golden/smolvla/ were
written by LeRobot 0.4.3 itself (tests/interop/smolvla_side.py) from two tiny SmolVLA directories
(one camera, PushCube's sizes, LeRobot's defaults; two cameras, one resized with padding, image
special tokens, a fixed prefix length, 3 layers with a self-attention layer every 3rd). For each,
two calls of a batch of 2 with fixed noise: the instruction's tokens, the normalised state, the
prefix and the un-normalised action chunk must equal LeRobot's float32 run to 1e-4. And what a
directory that cannot be loaded is told, in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncvla.common.policy.smolvla import LeRobotDirError, SmolVLA, read_policy_dir

GOLDEN = Path(__file__).parent / "golden" / "smolvla"
CASES = ("tiny_a", "tiny_b")
TOL = 1e-4


@pytest.fixture
def at_golden(monkeypatch):
    """The fixtures name their VLM "./vlm", relative to tests/golden/smolvla, as LeRobot resolves
    it (from the working directory)."""
    monkeypatch.chdir(GOLDEN)


def frames_of(z, call: str) -> dict:
    """The call's camera images as LeRobot was given them: uint8 [B, 3, H, W] / 255, float32."""
    prefix = f"{call}.in."
    return {k[len(prefix):]: z[k].astype(np.float32) / np.float32(255)
            for k in z if k.startswith(prefix + "observation.images")}


@pytest.mark.parametrize("case", CASES)
def test_actions_equal_lerobots_to_1e_4(case, at_golden):
    vla = SmolVLA.load(f"{case}/policy")
    z = np.load(f"{case}/io.npz")
    for call in ("c1", "c2"):
        ids, mask = vla.tokenize(list(z[f"{call}.in.task"]))
        assert np.array_equal(ids, z[f"{call}.pre.observation.language.tokens"]), call
        assert np.array_equal(mask, z[f"{call}.pre.observation.language.attention_mask"]), call
        state = z[f"{call}.in.observation.state"]
        normalised = vla.normalized_state(state)[:, :state.shape[1]].numpy()
        np.testing.assert_allclose(normalised, z[f"{call}.pre.observation.state"], atol=1e-6)
        frames = frames_of(z, call)
        pixels, present = vla.images(frames)
        prefix, _, _ = vla.net.embed_prefix(pixels, present, torch.as_tensor(ids), torch.as_tensor(mask),
                                            vla.normalized_state(state))
        np.testing.assert_allclose(prefix.detach().numpy(), z[f"fp32.{call}.prefix_embs"], atol=TOL)
        actions = vla.act_chunk(frames, state, ids, mask, z[f"{call}.noise"])
        assert actions.shape == z[f"fp32.{call}.actions"].shape
        err = np.abs(actions - z[f"fp32.{call}.actions"]).max()
        assert err <= TOL, f"{case} {call}: max |asyncvla - LeRobot| = {err:.3g}"


def test_uint8_frames_and_padding_to_max_length_give_the_same_chunk(at_golden):
    """Frames as envs give them (uint8 [B, H, W, 3]) are the same pixels; instructions padded to
    tokenizer_max_length instead of the longest give the same actions (the padding is masked)."""
    vla = SmolVLA.load("tiny_a/policy")
    z = np.load("tiny_a/io.npz")
    image = z["c1.in.observation.images.cam"]
    ids, mask = vla.tokenize(list(z["c1.in.task"]), max_length=True)
    assert ids.shape[1] == vla.spec.tokenizer_max_length
    actions = vla.act_chunk({"observation.images.cam": image.transpose(0, 2, 3, 1)}, z["c1.in.observation.state"],
                            ids, mask, z["c1.noise"])
    assert np.abs(actions - z["fp32.c1.actions"]).max() <= TOL


def test_older_checkpoints_keep_their_statistics_in_model_safetensors(tmp_path, at_golden):
    """No processor files: the normaliser buffers inside model.safetensors are read instead."""
    d = copy_case(tmp_path, "tiny_a")
    stats = load_file(str(d / "policy_preprocessor_step_5_normalizer_processor.safetensors"))
    for name in ("policy_preprocessor.json", "policy_postprocessor.json",
                 "policy_preprocessor_step_5_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        (d / name).unlink()
    weights = load_file(str(d / "model.safetensors"))
    weights.update({f"normalize_inputs.buffer_observation_state.{s}": stats[f"observation.state.{s}"]
                    for s in ("mean", "std")})
    weights.update({f"unnormalize_outputs.buffer_action.{s}": stats[f"action.{s}"] for s in ("mean", "std")})
    save_file(weights, str(d / "model.safetensors"))
    z = np.load("tiny_a/io.npz")
    vla = SmolVLA.load(d)
    actions = vla.act_chunk(frames_of(z, "c2"), z["c2.in.observation.state"], *vla.tokenize(list(z["c2.in.task"])),
                            z["c2.noise"])
    assert np.abs(actions - z["fp32.c2.actions"]).max() <= TOL


def copy_case(tmp_path: Path, case: str) -> Path:
    """A copy of the case's policy directory whose vlm_model_name is absolute."""
    d = tmp_path / case
    shutil.copytree(GOLDEN / case / "policy", d)
    config = json.loads((d / "config.json").read_text())
    config["vlm_model_name"] = str(GOLDEN / "vlm")
    (d / "config.json").write_text(json.dumps(config))
    return d


def edit_config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


def one_line_error(path) -> str:
    with pytest.raises(LeRobotDirError) as e:
        SmolVLA.load(path)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_a_directory_that_cannot_be_loaded_is_named_in_one_line(tmp_path):
    d = copy_case(tmp_path, "tiny_a")
    assert read_policy_dir(d).spec.action_dim == 4

    edit_config(d, type="pi0")
    message = one_line_error(d)
    assert "pi0" in message and "smolvla" in message and "config.json" in message
    edit_config(d, type="smolvla")

    weights = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "model.action_out_proj.bias"}, str(d / "model.safetensors"))
    assert "model.action_out_proj.bias" in one_line_error(d) and "missing" in one_line_error(d)
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, str(d / "model.safetensors"))
    assert "model.extra.weight" in one_line_error(d) and "unexpected" in one_line_error(d)
    save_file({**weights, "model.state_proj.bias": torch.zeros(3)}, str(d / "model.safetensors"))
    assert "model.state_proj.bias" in one_line_error(d) and "[3]" in one_line_error(d)
    save_file(weights, str(d / "model.safetensors"))

    (d / "policy_preprocessor_step_5_normalizer_processor.safetensors").unlink()
    message = one_line_error(d)
    assert "policy_preprocessor_step_5_normalizer_processor.safetensors" in message and "missing" in message
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        (d / name).unlink()
    message = one_line_error(d)
    assert "action.mean" in message or "observation.state.mean" in message

    d = copy_case(tmp_path / "again", "tiny_a")
    edit_config(d, vlm_model_name="no/such/vlm")
    assert "vlm_model_name='no/such/vlm'" in one_line_error(d)
    edit_config(d, vlm_model_name=str(GOLDEN / "vlm"), chunk_size=0)
    assert "chunk_size=0" in one_line_error(d)
    edit_config(d, chunk_size=8, output_features={"action": {"type": "ACTION", "shape": [40]}})
    assert "max_action_dim=16" in one_line_error(d)


def test_statistics_of_another_size_than_their_feature_are_named(tmp_path):
    """A 25-D state in config.json with the 9-D state's statistics (a config edited, its processor
    files not): refused when read, naming the statistic, not failing in the first act()."""
    d = copy_case(tmp_path, "tiny_a")
    features = json.loads((d / "config.json").read_text())["input_features"]
    features["observation.state"]["shape"] = [12]
    edit_config(d, input_features=features)
    message = one_line_error(d)
    assert "observation.state.mean has 9 values" in message and "12 dimensions" in message, message
