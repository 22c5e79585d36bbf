"""VLAPolicy with policy.action_head=flow: act and evaluate agree, SFT's flow loss trains it, it
round-trips through save_pretrained, and bad chains or mismatched checkpoints get one line."""

import numpy as np
import pytest
import torch

from asyncvla.common.config import load_config
from asyncvla.common.policy import VLAPolicy

B = 3


def policy(*overrides):
    cfg = load_config("configs/pixel_task.yaml", ["policy.action_head=flow", *overrides])
    return VLAPolicy.build(cfg.policy), cfg


def batch(p, seed=0):
    rng = np.random.default_rng(seed)
    size = p.cfg.image_size
    ids, mask = p.tokenize(["reach the red dot", "reach", "go to the dot"])
    state = rng.standard_normal((B, p.cfg.state_dim)).astype(np.float32) if p.cfg.state_dim else None
    return rng.integers(0, 255, (B, size, size, 3), dtype=np.uint8), ids, mask, state


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_the_learner_scores_the_actors_chain_as_the_actor_did(method):
    p, cfg = policy(f"policy.flow.noise_method={method}", "policy.flow.num_steps=5")
    obs = batch(p)
    out = p.act(*obs, generator=torch.Generator().manual_seed(0))
    k, d = cfg.policy.num_action_chunks, cfg.policy.action_dim
    chain, stochastic = out.replay["flow_chain"], out.replay["flow_stochastic"]
    assert out.actions.shape == (B, k, d) and chain.shape == (B, 6, k, d)
    assert set(out.replay) == {"flow_chain", "flow_stochastic"} and out.logprobs.shape == (B, k * d)
    assert stochastic.dtype == np.uint8 and stochastic.sum(1).tolist() == ([1] * B if method == "flow_sde" else [5] * B)
    low, high = np.array(p.action_tokenizer.low), np.array(p.action_tokenizer.high)
    assert np.all(out.actions >= low - 1e-6) and np.all(out.actions <= high + 1e-6)
    for level, width in (("token_level", k * d), ("action_level", k), ("chunk_level", 1)):
        ev = p.evaluate(*obs, out.replay, level)
        assert ev.logprobs.shape == (B, width)
        expect = torch.as_tensor(out.logprobs).reshape(B, k, d)
        expect = {"token_level": expect.reshape(B, -1), "action_level": expect.sum(-1),
                  "chunk_level": expect.sum((1, 2))[:, None]}[level]
        torch.testing.assert_close(ev.logprobs.detach(), expect, atol=1e-5, rtol=0)
        torch.testing.assert_close(ev.values.detach(), torch.as_tensor(out.values), atol=1e-6, rtol=0)


def test_greedy_integrates_the_same_ode_from_the_same_noise():
    p, _ = policy()
    obs = batch(p, 1)
    a = p.act(*obs, greedy=True, generator=torch.Generator().manual_seed(3))
    b = p.act(*obs, greedy=True, generator=torch.Generator().manual_seed(3))
    c = p.act(*obs, greedy=True, generator=torch.Generator().manual_seed(4))
    assert not a.replay["flow_stochastic"].any() and np.array_equal(a.actions, b.actions)
    assert not np.allclose(a.actions, c.actions)


def test_flow_matching_sft_lowers_its_loss_and_trains_expert_and_backbone():
    p, _ = policy()
    obs = batch(p, 2)
    target = np.random.default_rng(0).uniform(-0.8, 0.8, (B, p.cfg.num_action_chunks, p.cfg.action_dim))
    p.train()
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=3e-3)
    first = None
    for step in range(60):
        loss = p.sft_loss(*obs, target.astype(np.float32), torch.Generator().manual_seed(step % 4)).loss.mean()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first = loss.item()
            assert p.flow_expert.velocity_out.weight.grad.abs().sum() > 0
            assert any(q.grad is not None and q.grad.abs().sum() > 0 for n, q in p.named_parameters()
                       if n.startswith("backbone."))
        opt.step()
    last = np.mean([p.sft_loss(*obs, target.astype(np.float32), torch.Generator().manual_seed(s)).loss.mean().item()
                    for s in range(4)])
    assert last < 0.5 * first, (first, last)


def test_a_flow_policy_round_trips_and_mismatches_are_named(tmp_path):
    p, cfg = policy("policy.flow.noise_method=flow_noise")
    obs = batch(p, 3)
    p.save_pretrained(str(tmp_path / "flow"))
    q = VLAPolicy.from_pretrained(str(tmp_path / "flow"))
    a = p.act(*obs, generator=torch.Generator().manual_seed(5))
    b = q.act(*obs, generator=torch.Generator().manual_seed(5))
    assert np.array_equal(a.actions, b.actions) and np.array_equal(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match=r"policy.flow.width=128 .* saved with flow.width=64"):
        VLAPolicy.build(load_config("configs/pixel_task.yaml", [
            "policy.action_head=flow", "policy.flow.noise_method=flow_noise", "policy.flow.width=128",
            f"policy.pretrained_path={tmp_path / 'flow'}"]).policy)
    with pytest.raises(ValueError, match=r"policy.action_head='parallel' .* saved with action_head='flow'"):
        VLAPolicy.build(load_config("configs/pixel_task.yaml", [
            "policy.action_head=parallel", f"policy.pretrained_path={tmp_path / 'flow'}"]).policy)
    steps = VLAPolicy.build(load_config("configs/pixel_task.yaml", [      # sampling settings may change
        "policy.action_head=flow", "policy.flow.noise_method=flow_noise", "policy.flow.num_steps=8",
        f"policy.pretrained_path={tmp_path / 'flow'}"]).policy)
    assert steps.act(*obs).replay["flow_chain"].shape[1] == 9


@pytest.mark.parametrize("saved, wanted", [("flow_sde", "flow_noise"), ("flow_noise", "flow_sde")])
def test_one_flow_checkpoint_warm_starts_either_noise_method(tmp_path, saved, wanted):
    p, _ = policy(f"policy.flow.noise_method={saved}")
    obs = batch(p)
    p.save_pretrained(str(tmp_path / "sft"))
    q = VLAPolicy.build(load_config("configs/pixel_task.yaml", [
        "policy.action_head=flow", f"policy.flow.noise_method={wanted}",
        f"policy.pretrained_path={tmp_path / 'sft'}"]).policy)
    assert (q.flow_expert.noise_out is not None) == (wanted == "flow_noise")
    assert all(p.requires_grad for p in q.flow_expert.parameters())
    # the same initial noise, then the ODE: it reads the velocity alone, which both share
    greedy = [m.act(*obs, greedy=True, generator=torch.Generator().manual_seed(1)).actions for m in (p, q)]
    assert np.array_equal(*greedy)
    out = q.act(*obs, generator=torch.Generator().manual_seed(1))
    assert np.isfinite(out.logprobs).all()
    q.save_pretrained(str(tmp_path / "rl"))                          # and it saves as what it now is
    r = VLAPolicy.from_pretrained(str(tmp_path / "rl"))
    assert r.cfg.flow.noise_method == wanted
    assert np.array_equal(r.act(*obs, generator=torch.Generator().manual_seed(1)).actions, out.actions)


def test_bad_chains_and_flow_settings_get_one_line():
    p, cfg = policy()
    obs = batch(p)
    out = p.act(*obs)
    with pytest.raises(ValueError, match="pass flow_chain and flow_stochastic"):
        p.evaluate(*obs, {"action_tokens": np.zeros((B, 8), np.int64)})
    with pytest.raises(ValueError, match=r"flow_chain must be float \[B=3, S\+1=5"):
        p.evaluate(*obs, {**out.replay, "flow_chain": out.replay["flow_chain"][:, :3]})
    bad = out.replay["flow_chain"].copy()
    bad[0, 1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        p.evaluate(*obs, {**out.replay, "flow_chain": bad})
    from asyncvla.common.config import ConfigError
    for override, words in [("policy.flow.heads=6", "policy.flow.heads=6 must be a multiple of policy.flow.kv_heads"),
                            ("policy.flow.noise_level=0", "policy.flow.noise_level=0"),
                            ("policy.flow.num_steps=0", "policy.flow.num_steps=0")]:
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            load_config("configs/pixel_task.yaml", ["policy.action_head=flow", "policy.flow.kv_heads=4", override])


def test_pi0_config_has_pi0s_shape_on_the_meta_device():
    """configs/pi0_gpu.yaml: a PaliGemma-3B-shaped backbone (2.94 B; published 2.92 B, our SigLIP
    MLP is 4x its width) and a Gemma-300M-shaped expert (0.32 B): 3.26 B, pi0's ~3.3 B; only the
    expert and the value head train."""
    from transformers import PaliGemmaForConditionalGeneration

    from asyncvla.common.policy.backbone import build_tiny_tokenizer, tiny_backbone_config
    from asyncvla.common.policy.families import family_by_name
    from asyncvla.common.policy.flow_expert import FlowExpert

    cfg = load_config("configs/pi0_gpu.yaml")
    p, f = cfg.policy, cfg.policy.flow
    family = family_by_name(p.backbone.family)
    config = tiny_backbone_config(p.backbone, p.image_size, build_tiny_tokenizer(p.backbone.vocab_size - p.n_bins,
                                                                                 family), family)
    with torch.device("meta"):
        vlm = PaliGemmaForConditionalGeneration(config)
        expert = FlowExpert(p.action_dim, p.num_action_chunks, p.backbone.text_hidden_size, f.width, f.depth,
                            f.heads, f.kv_heads, f.head_dim, f.mlp)
    backbone = sum(t.numel() for t in vlm.parameters())
    head = sum(t.numel() for t in expert.parameters())
    assert 2.9e9 < backbone < 3.0e9 and 0.30e9 < head < 0.33e9 and 3.2e9 < backbone + head < 3.35e9, (backbone, head)
    assert p.action_head == "flow" and f.train_expert_only and cfg.actor.device == "cuda"


def test_expert_only_training_freezes_the_vlm():
    p, _ = policy("policy.flow.train_expert_only=true", "policy.is_lora=true")
    trainable = {n for n, q in p.named_parameters() if q.requires_grad}
    assert trainable and all(n.startswith(("flow_expert.", "value_head.", "state_encoder.", "image_tokens.",
                                           "action_queries.")) for n in trainable)
    assert any(n.startswith("flow_expert.") for n in trainable)


def test_a_bf16_backbone_feeds_the_fp32_expert():
    """policy.precision=bf16 (a GPU's default) keeps the heads in fp32: the expert takes the VLM's
    bf16 hidden states and the fp32 chain, and evaluate still scores act's chain exactly."""
    p, _ = policy("policy.precision=bf16")
    assert next(p.backbone.parameters()).dtype == torch.bfloat16
    assert next(p.flow_expert.parameters()).dtype == torch.float32
    obs = batch(p, 4)
    out = p.act(*obs, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ev = p.evaluate(*obs, out.replay)
    torch.testing.assert_close(ev.logprobs, torch.as_tensor(out.logprobs), atol=1e-5, rtol=0)
