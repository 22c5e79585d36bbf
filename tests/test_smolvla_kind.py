"""SmolVLA as an asyncvla policy (common/policy/smolvla/kind.py), on the LeRobot-written tiny
SmolVLA of tests/golden/smolvla: acting draws a chain whose log-prob the learner's `evaluate`
reproduces; greedy acting is LeRobot's own denoising; the value head and the action expert train,
and of the VLM nothing, LoRA adapters or every weight, as the settings say; saved and loaded it acts
the same (LoRA merged into LeRobot's tensors); the run's settings are checked against the directory's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncvla.common.config import FlowConfig, PolicyConfig
from asyncvla.common.policy.smolvla import LeRobotDirError, SmolVLA
from asyncvla.common.policy.smolvla.kind import SmolVLAPolicy
from tests.test_smolvla import copy_case

K = 4


def policy_config(**kw) -> PolicyConfig:
    """The VLM frozen (policy.flow.train_expert_only), unless `flow` says otherwise."""
    return PolicyConfig(**{"image_size": 64, "action_dim": 4, "state_dim": 9, "num_action_chunks": K,
                           "max_instruction_tokens": 16, "flow": FlowConfig(noise_level=0.5, train_expert_only=True),
                           **kw})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return copy_case(tmp_path_factory.mktemp("smolvla"), "tiny_a")


def observation(b: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8)
    state = rng.normal(size=(b, 9)).astype(np.float32)
    return image, state


def test_the_learner_scores_the_actors_chain_as_the_actor_did(source):
    policy = SmolVLAPolicy.from_lerobot(source, policy_config())
    image, state = observation()
    ids, mask = policy.tokenize(["push the cube to the goal"] * 3)
    out = policy.act(image, ids, mask, state, generator=torch.Generator().manual_seed(1))
    assert out.actions.shape == (3, K, 4) and out.logprobs.shape == (3, K * 4) and out.values.shape == (3,)
    assert out.replay["flow_chain"].shape == (3, 5, 8, 16) and out.replay["flow_stochastic"].sum(1).tolist() == [1] * 3
    scored = policy.evaluate(image, ids, mask, state, out.replay)
    np.testing.assert_allclose(scored.logprobs.detach().numpy(), out.logprobs, atol=1e-4)
    np.testing.assert_allclose(scored.values.detach().numpy(), out.values, atol=1e-5)

    # what trains: the expert, the projections and the value head; never the VLM
    scored.logprobs.sum().add(scored.values.sum()).backward()
    grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in policy.named_parameters()}
    assert not any(g for n, g in grads.items() if n.startswith("net.vlm_with_expert.vlm."))
    for part in ("net.vlm_with_expert.lm_expert.layers.0.self_attn.q_proj.weight", "net.action_in_proj.weight",
                 "net.action_out_proj.weight", "net.state_proj.weight", "value_head.fc2.weight"):
        assert grads[part], part
    assert set(policy.trainable_state_dict()) == {n for n, p in policy.named_parameters() if p.requires_grad}


def test_greedy_acting_is_lerobots_denoising(source):
    policy = SmolVLAPolicy.from_lerobot(source, policy_config())
    image, state = observation(2, seed=1)
    ids, mask = policy.tokenize(["push the cube to the goal", "move the arm to the left"])
    greedy = policy.act(image, ids, mask, state, greedy=True, generator=torch.Generator().manual_seed(3))
    noise = torch.randn((2, 8, 16), generator=torch.Generator().manual_seed(3))
    vla = SmolVLA.load(source)
    lerobot = vla.act_chunk({"observation.images.cam": image}, state, *vla.tokenize(["push the cube to the goal",
                                                                                      "move the arm to the left"]),
                            noise)
    np.testing.assert_allclose(greedy.actions, lerobot[:, :K], atol=1e-4)


def test_saved_and_loaded_it_acts_the_same_and_sft_trains_it(source, tmp_path):
    policy = SmolVLAPolicy.from_lerobot(source, policy_config())
    with torch.no_grad():
        policy.value_head.fc2.weight.add_(0.5)          # (a value head that is not the fresh one)
    image, state = observation(2, seed=2)
    ids, mask = policy.tokenize(["push the cube to the goal"] * 2)
    loss = policy.sft_loss(image, ids, mask, state, np.zeros((2, K, 4), np.float32),
                           generator=torch.Generator().manual_seed(0))
    assert loss.loss.shape == (2,) and torch.isfinite(loss.loss).all() and loss.loss.requires_grad
    policy.save_pretrained(tmp_path / "p")
    again = SmolVLAPolicy.from_pretrained(tmp_path / "p")
    a = policy.act(image, ids, mask, state, generator=torch.Generator().manual_seed(5))
    b = again.act(image, ids, mask, state, generator=torch.Generator().manual_seed(5))
    for x, y in ((a.actions, b.actions), (a.logprobs, b.logprobs), (a.values, b.values)):
        np.testing.assert_array_equal(x, y)
    saved = SmolVLA.load(tmp_path / "p" / "lerobot")                  # (LeRobot's layout, its VLM "../vlm")
    assert saved.spec == dataclasses.replace(policy.spec, vlm_model_name="../vlm")


def test_a_cnn_critic_reads_the_image_and_is_saved_with_the_policy(source, tmp_path):
    """policy.value_encoder cnn: the value head adds a CNN of the image (its shifted copy when the
    learner passes value_image), trains it with the VLM frozen, and a saved policy keeps it."""
    policy = SmolVLAPolicy.from_lerobot(source, policy_config(value_encoder="cnn"))
    assert policy.value_head.encoder is not None
    image, state = observation(2, seed=4)
    ids, mask = policy.tokenize(["push the cube to the goal"] * 2)
    with torch.no_grad():
        policy.value_head.fc2.weight.normal_()          # (values that are not ~0 everywhere)
    out = policy.act(image, ids, mask, state, generator=torch.Generator().manual_seed(0))
    replay = out.replay
    shifted = np.roll(image, 7, axis=1)
    v = policy.evaluate(image, ids, mask, state, replay).values
    v_shift = policy.evaluate(image, ids, mask, state, replay, value_image=shifted).values
    np.testing.assert_allclose(v.detach().numpy(), out.values, atol=1e-5)
    assert not torch.allclose(v, v_shift)                # the CNN reads the image it is given
    v.sum().backward()
    assert policy.value_head.encoder.proj.weight.grad.abs().sum() > 0
    assert "value_head.encoder.proj.weight" in policy.trainable_state_dict()
    policy.save_pretrained(tmp_path / "p")
    again = SmolVLAPolicy.from_pretrained(tmp_path / "p")
    np.testing.assert_array_equal(again.act(image, ids, mask, state, generator=torch.Generator().manual_seed(0)).values,
                                  out.values)


def test_the_runs_settings_must_fit_the_directory(source):
    with pytest.raises(LeRobotDirError, match=r"policy.action_dim=5 but its action has 4"):
        SmolVLAPolicy.from_lerobot(source, policy_config(action_dim=5))
    with pytest.raises(LeRobotDirError, match=r"policy.num_action_chunks=9 is above its chunk_size=8"):
        SmolVLAPolicy.from_lerobot(source, policy_config(num_action_chunks=9))
    with pytest.raises(LeRobotDirError, match=r"policy.state_dim=0 but its observation.state has 9"):
        SmolVLAPolicy.from_lerobot(source, policy_config(state_dim=0))


def test_the_vlm_trains_frozen_with_lora_or_whole_and_lora_is_merged_into_what_is_saved(source, tmp_path):
    frozen = SmolVLAPolicy.from_lerobot(source, policy_config())
    lora = SmolVLAPolicy.from_lerobot(source, policy_config(flow=FlowConfig(noise_level=0.5), is_lora=True,
                                                            lora_rank=4))
    full = SmolVLAPolicy.from_lerobot(source, policy_config(flow=FlowConfig(noise_level=0.5), is_lora=False))

    def vlm_trainable(policy):
        return {n for n, p in policy.named_parameters() if p.requires_grad and n.startswith("net.vlm_with_expert.vlm.")}
    assert vlm_trainable(frozen) == set()
    adapted = vlm_trainable(lora)
    assert adapted and all(".lora_" in n and "text_model" in n for n in adapted)
    assert {n.split(".self_attn.")[1].split(".")[0] for n in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(vlm_trainable(full)) == sum(1 for n, _ in full.named_parameters() if n.startswith("net.vlm_with_expert.vlm."))
    for policy in (frozen, lora, full):           # (the expert, the projections and the value head in each)
        assert set(policy.trainable_state_dict()) == {n for n, p in policy.named_parameters() if p.requires_grad}
        assert "net.action_out_proj.weight" in policy.trainable_state_dict()

    # fresh adapters change nothing; moved ones change the chunk, and a save holds them merged
    image, state = observation(2, seed=4)
    ids, mask = lora.tokenize(["push the cube to the goal"] * 2)
    act = lambda p: p.act(image, ids, mask, state, greedy=True, generator=torch.Generator().manual_seed(7))  # noqa: E731
    np.testing.assert_allclose(act(lora).actions, act(frozen).actions, atol=1e-6)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    moved = act(lora).actions
    assert np.abs(moved - act(frozen).actions).max() > 1e-3
    lora.save_pretrained(tmp_path / "p")
    tensors = load_file(str(tmp_path / "p" / "lerobot" / "model.safetensors"))
    assert not any("lora_" in n or "base_layer" in n for n in tensors)
    assert set(tensors) == set(load_file(str(source / "model.safetensors")))
    again = SmolVLAPolicy.from_pretrained(tmp_path / "p")               # (merged weights, fresh adapters)
    np.testing.assert_allclose(act(again).actions, moved, atol=1e-5)
    vla = SmolVLA.load(tmp_path / "p" / "lerobot")                       # (as LeRobot reads the directory)
    noise = torch.randn((2, 8, 16), generator=torch.Generator().manual_seed(7))
    np.testing.assert_allclose(vla.act_chunk({"observation.images.cam": image}, state, *vla.tokenize(
        ["push the cube to the goal"] * 2), noise)[:, :K], moved, atol=1e-4)
