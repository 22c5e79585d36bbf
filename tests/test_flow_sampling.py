"""Flow chains (common/policy/flow_sampling.py): the learner's recomputed log-prob of a stored
chain is the actor's, for Flow-SDE and Flow-Noise, and the ODE path is plain Euler."""

import pytest
import torch

from asyncvla.common.policy import flow as F
from asyncvla.common.policy.flow_expert import FlowExpert
from asyncvla.common.policy.flow_sampling import FlowSampling, chain_logprob, sample_chain

B, K, D, P, W, LAYERS = 6, 4, 3, 5, 16, 2


def setup(method: str, seed: int = 0):
    torch.manual_seed(seed)
    expert = FlowExpert(action_dim=D, num_actions=K, prefix_width=W, width=32, depth=2, heads=4, kv_heads=1,
                        head_dim=8, mlp=64, learn_noise=method == "flow_noise").eval()
    g = torch.Generator().manual_seed(seed)
    hidden = tuple(torch.randn(B, P, W, generator=g) for _ in range(LAYERS + 1))
    mask = torch.ones(B, P, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        kv = expert.prefix_kv(hidden, LAYERS)
    return expert, kv, mask, hidden


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_the_learner_recomputes_the_actors_log_prob_of_a_stored_chain(method, num_steps):
    expert, kv, mask, hidden = setup(method)
    s = FlowSampling(num_steps=num_steps, noise_method=method)
    out = sample_chain(expert, s, kv, mask, (B, K, D), generator=torch.Generator().manual_seed(1))
    assert out.chain.shape == (B, num_steps + 1, K, D) and out.stochastic.shape == (B, num_steps)
    expected_steps = 1 if method == "flow_sde" else num_steps
    assert out.stochastic.sum(1).tolist() == [expected_steps] * B
    # The learner: prefix recomputed from the same hidden states, chain and mask from the segment.
    logp, entropy = chain_logprob(expert, s, expert.prefix_kv(hidden, LAYERS), mask, out.chain, out.stochastic)
    torch.testing.assert_close(logp, out.logp, atol=1e-5, rtol=0)
    assert torch.isfinite(entropy).all() and entropy.shape == (B, K, D)
    with torch.no_grad():                                      # other weights: another number
        expert.velocity_out.weight.add_(0.05)
    moved, _ = chain_logprob(expert, s, expert.prefix_kv(hidden, LAYERS), mask, out.chain, out.stochastic)
    assert (moved - out.logp).abs().max() > 1e-3


def test_flow_sde_step_log_prob_matches_a_per_sample_loop():
    expert, kv, mask, _ = setup("flow_sde", seed=3)
    s = FlowSampling(num_steps=5, noise_method="flow_sde", noise_level=0.7)
    out = sample_chain(expert, s, kv, mask, (B, K, D), generator=torch.Generator().manual_seed(2))
    grid = F.time_grid(5)
    for b in range(B):
        k = int(out.stochastic[b].nonzero())
        one_kv = [(kk[b:b + 1], vv[b:b + 1]) for kk, vv in kv]
        x = out.chain[b:b + 1, k]
        with torch.no_grad():
            v = expert(x, grid[k:k + 1], one_kv, mask[b:b + 1])
        mean, std = F.sde_step(x, v, grid[k].item(), grid[k + 1].item(), 0.7, s.t_cap)
        naive = torch.distributions.Normal(mean, std).log_prob(out.chain[b:b + 1, k + 1])
        torch.testing.assert_close(out.logp[b:b + 1], naive, atol=1e-5, rtol=0)


def test_greedy_is_the_euler_ode_and_has_no_log_prob():
    expert, kv, mask, _ = setup("flow_sde")
    s = FlowSampling(num_steps=4)
    out = sample_chain(expert, s, kv, mask, (B, K, D), greedy=True, generator=torch.Generator().manual_seed(5))
    assert not out.stochastic.any() and torch.all(out.logp == 0)
    x, grid = out.chain[:, 0], F.time_grid(4)
    with torch.no_grad():
        for i in range(4):
            x = x + (grid[i + 1] - grid[i]) * expert(x, grid[i].expand(B), kv, mask)
            torch.testing.assert_close(out.chain[:, i + 1], x, atol=1e-6, rtol=0)
    again = sample_chain(expert, s, kv, mask, (B, K, D), greedy=True, generator=torch.Generator().manual_seed(5))
    assert torch.equal(again.chain, out.chain)
    with pytest.raises(ValueError, match="no Gaussian step"):
        chain_logprob(expert, s, kv, mask, out.chain, out.stochastic)


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_the_recomputed_log_prob_trains_the_expert(method):
    expert, kv, mask, hidden = setup(method)
    s = FlowSampling(num_steps=4, noise_method=method)
    out = sample_chain(expert, s, kv, mask, (B, K, D), generator=torch.Generator().manual_seed(1))
    logp, entropy = chain_logprob(expert, s, expert.prefix_kv(hidden, LAYERS), mask, out.chain, out.stochastic)
    (logp.mean() + entropy.mean()).backward()
    assert expert.velocity_out.weight.grad.abs().sum() > 0 and expert.prefix_in.weight.grad.abs().sum() > 0
    if method == "flow_noise":
        assert expert.noise_out.weight.grad.abs().sum() > 0


def test_bad_settings_and_chains_get_one_line_naming_the_key():
    for kw, words in [(dict(num_steps=0), "policy.flow.num_steps=0"), (dict(noise_level=0.0), "noise_level=0.0"),
                      (dict(noise_method="ddim"), "choose one of ['flow_sde', 'flow_noise']"),
                      (dict(log_std_min=-1.0, log_std_max=-2.0), "log_std_min=-1.0 must be <")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            FlowSampling(**kw)
    expert, kv, mask, _ = setup("flow_sde")
    with pytest.raises(ValueError, match="does not fit stochastic"):
        chain_logprob(expert, FlowSampling(), kv, mask, torch.zeros(B, 3, K, D), torch.ones(B, 4, dtype=torch.bool))
