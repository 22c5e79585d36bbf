"""The flow head's action expert (common/policy/flow_expert.py): what it reads and its size."""

import pytest
import torch

from asyncvla.common.policy.flow_expert import FlowExpert

B, K, D, P, VLM_WIDTH, VLM_LAYERS = 2, 4, 3, 5, 16, 4


def expert(**kw):
    torch.manual_seed(0)
    args = dict(action_dim=D, num_actions=K, prefix_width=VLM_WIDTH, width=32, depth=2, heads=4, kv_heads=2,
                head_dim=8, mlp=64)
    return FlowExpert(**{**args, **kw}).eval()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = tuple(torch.randn(B, P, VLM_WIDTH, generator=g) for _ in range(VLM_LAYERS + 1))
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :2] = 0                                   # left padding in the second prompt
    return torch.randn(B, K, D, generator=g), torch.rand(B, generator=g), hidden, mask


def test_velocity_has_the_chunk_shape_and_reads_time_prefix_and_every_action():
    e, (x, t, hidden, mask) = expert(), inputs()
    with torch.no_grad():
        kv = e.prefix_kv(hidden, VLM_LAYERS)
        v = e(x, t, kv, mask)
        assert v.shape == (B, K, D)
        assert not torch.allclose(e(x, t * 0.5, kv, mask), v, atol=1e-4)           # time
        changed = tuple(h.clone() for h in hidden)
        changed[-1][:, -1] += 1.0                                                   # a real prefix token
        assert not torch.allclose(e(x, t, e.prefix_kv(changed, VLM_LAYERS), mask), v, atol=1e-4)
        padded = tuple(h.clone() for h in hidden)
        for h in padded:
            h[1, :2] = 100.0                                                        # padding only
        torch.testing.assert_close(e(x, t, e.prefix_kv(padded, VLM_LAYERS), mask), v)
        later = x.clone()
        later[:, -1] += 1.0                                                         # the last action
        assert not torch.allclose(e(later, t, kv, mask)[:, 0], v[:, 0], atol=1e-4)  # seen by the first


def test_expert_layers_read_matching_vlm_layers_and_the_top_one_last():
    assert [expert(depth=2).vlm_layer_of(i, 4) for i in range(2)] == [2, 4]
    assert [expert(depth=4).vlm_layer_of(i, 4) for i in range(4)] == [1, 2, 3, 4]
    assert [expert(depth=3).vlm_layer_of(i, 2) for i in range(3)] == [1, 1, 2]


def test_flow_noise_logits_come_from_the_same_pass_and_gradients_reach_the_prefix_projection():
    e, (x, t, hidden, mask) = expert(learn_noise=True), inputs(1)
    v, raw = e.velocity_and_noise(x, t, e.prefix_kv(hidden, VLM_LAYERS), mask)
    assert v.shape == raw.shape == (B, K, D)
    (v.pow(2).mean() + raw.mean()).backward()
    assert e.prefix_in.weight.grad.abs().sum() > 0 and e.noise_out.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="learn_noise"):
        expert().velocity_and_noise(x, t, e.prefix_kv(hidden, VLM_LAYERS), mask)
    with pytest.raises(ValueError, match="heads=6 must be a multiple of kv_heads=4"):
        expert(heads=6, kv_heads=4)


def test_pi0_shaped_expert_has_gemma_300m_parameters():
    """pi0's expert: width 1024, 18 layers, MLP 4096, 8 heads, 1 KV head of 256, beside a
    PaliGemma (2048 wide) prefix; built on the meta device, counted against the formula."""
    w, depth, mlp, heads, head_dim, prefix, d, k = 1024, 18, 4096, 8, 256, 2048, 7, 50
    with torch.device("meta"):
        e = FlowExpert(action_dim=d, num_actions=k, prefix_width=prefix, width=w, depth=depth, heads=heads,
                       kv_heads=1, head_dim=head_dim, mlp=mlp)
    per_layer = 2 * w * heads * head_dim + 2 * w * head_dim + 3 * w * mlp + 3 * w
    extras = (d * w + w) + (2 * w * w + w + w * w + w) + k * w + prefix * w + w + (w * d + d)
    count = sum(p.numel() for p in e.parameters())
    assert count == depth * per_layer + extras
    assert 0.30e9 < count < 0.33e9, count
