"""The Gaussian head (policy.action_head=gaussian) against torch.distributions: its log-probs and
entropies at every logprob_type, that the learner scores the actor's draw as the actor did, that
greedy acts at the mean, that its log-std stays in bounds, and that SFT by log-likelihood fits
both the mean and the std of the demos."""

import numpy as np
import pytest
import torch
from torch.distributions import Independent, Normal

from asyncvla.common.config import ConfigError, load_config
from asyncvla.common.policy import VLAPolicy
from tests.support.paths import PIXEL

B = 3


def gaussian_policy(*overrides, seed=0):
    torch.manual_seed(seed)
    cfg = load_config(PIXEL, ["policy.action_head=gaussian", *overrides])
    return VLAPolicy.build(cfg.policy)


def observation(policy, seed=0):
    rng = np.random.default_rng(seed)
    size = policy.cfg.image_size
    ids, mask = policy.tokenize(["reach the red dot", "reach", "go to the dot"])
    return rng.integers(0, 255, (B, size, size, 3), dtype=np.uint8), ids, mask, None


def mean_and_std(policy, obs):
    """The head's distribution, read off its parts (not through act/evaluate)."""
    with torch.no_grad():
        from asyncvla.common.policy.heads.queries import query_pass
        prompt = policy._prompt(*policy._inputs(*obs))
        hidden, _ = query_pass(policy, prompt, policy.action_queries)
        mean, std = policy.gaussian(hidden)
    return mean, std.expand_as(mean)


@pytest.mark.parametrize("level,group", [("token_level", 1), ("action_level", 2), ("chunk_level", 8)])
def test_logprob_and_entropy_match_torch_distributions(level, group):
    p = gaussian_policy()
    obs = observation(p)
    act = p.act(*obs, generator=torch.Generator().manual_seed(3))
    x = torch.as_tensor(act.replay["gaussian_action"]).reshape(B, -1)
    mean, std = mean_and_std(p, obs)
    normal = Normal(mean, std)
    with torch.no_grad():
        out = p.evaluate(*obs, act.replay, logprob_type=level)
    # per entry, summed over `group` entries (D for action_level, K*D for chunk_level)
    want = normal.log_prob(x).reshape(B, -1, group).sum(-1)
    assert torch.allclose(out.logprobs, want, atol=1e-5)
    assert torch.allclose(torch.as_tensor(act.logprobs), normal.log_prob(x), atol=1e-5)   # act: per entry
    assert torch.allclose(out.entropy, normal.entropy().reshape(B, -1, group).sum(-1), atol=1e-5)
    whole = Independent(normal, 1)                   # the chunk as one K*D-dim diagonal Gaussian
    if level == "chunk_level":
        assert torch.allclose(out.logprobs[:, 0], whole.log_prob(x), atol=1e-4)
        assert torch.allclose(out.entropy[:, 0], whole.entropy(), atol=1e-4)


def test_draws_follow_the_generator_greedy_is_the_mean_and_actions_are_the_draw_in_env_units():
    p = gaussian_policy()
    obs = observation(p)
    a = p.act(*obs, generator=torch.Generator().manual_seed(7))
    b = p.act(*obs, generator=torch.Generator().manual_seed(7))
    c = p.act(*obs, generator=torch.Generator().manual_seed(8))
    assert np.array_equal(a.actions, b.actions) and not np.array_equal(a.actions, c.actions)
    mean, _ = mean_and_std(p, obs)
    greedy = p.act(*obs, greedy=True)
    assert np.allclose(greedy.replay["gaussian_action"].reshape(B, -1), mean.numpy(), atol=1e-6)
    k, d = p.cfg.num_action_chunks, p.cfg.action_dim
    unit = torch.as_tensor(a.replay["gaussian_action"])
    assert a.actions.shape == (B, k, d) and unit.shape == (B, k, d)
    assert np.allclose(a.actions, p.action_tokenizer.from_unit(unit).numpy(), atol=1e-6)


def test_the_learned_log_std_stays_within_its_bounds():
    p = gaussian_policy("policy.gaussian.log_std_init=-1.0", "policy.gaussian.log_std_min=-3.0",
                        "policy.gaussian.log_std_max=0.0")
    _, std = mean_and_std(p, observation(p))
    assert torch.allclose(std.log(), torch.full_like(std, -1.0), atol=1e-5)      # starts at log_std_init
    with torch.no_grad():
        p.gaussian.raw_log_std.fill_(1e4)
        assert torch.allclose(mean_and_std(p, observation(p))[1].log(), torch.zeros(B, std.shape[1]), atol=1e-5)
        p.gaussian.raw_log_std.fill_(-1e4)
        assert torch.allclose(mean_and_std(p, observation(p))[1].log(), torch.full((B, std.shape[1]), -3.0),
                              atol=1e-5)
    with pytest.raises(ConfigError, match="log_std"):
        gaussian_policy("policy.gaussian.log_std_init=1.0", "policy.gaussian.log_std_max=0.0")


def test_sft_by_log_likelihood_fits_the_demos_mean_and_spread():
    """Demos: one fixed chunk plus noise of std 0.1 (unit range). Minimising the head's NLL moves
    the mean onto the chunk and the std towards 0.1 (it starts at exp(log_std_init))."""
    torch.manual_seed(0)
    p = gaussian_policy()
    obs = observation(p)
    k, d = p.cfg.num_action_chunks, p.cfg.action_dim
    centre = torch.linspace(-0.5, 0.5, k * d).reshape(1, k, d)
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(1)
    first = None
    for _ in range(300):
        unit = centre + 0.1 * torch.randn(B, k, d, generator=g)
        loss, _, stats = p.sft_loss(*obs, p.action_tokenizer.from_unit(unit))
        first = loss.mean().item() if first is None else first
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    mean, std = mean_and_std(p, obs)
    assert loss.mean().item() < first - 1.0
    assert (mean - centre.reshape(1, -1)).abs().max() < 0.08
    assert 0.05 < std.mean().item() < 0.2
