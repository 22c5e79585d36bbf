"""The flow-matching math (common/policy/flow.py) against naive loops and closed forms."""

import math

import pytest
import torch

from asyncvla.common.policy import flow as F
from asyncvla.common.policy.logprobs import LOGPROB_LEVELS


def test_time_grid_runs_from_noise_to_action():
    assert F.time_grid(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert F.time_grid(1).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="num_steps=0"):
        F.time_grid(0)


def test_sample_time_follows_beta_alpha_1():
    t = F.sample_time((200_000,), torch.Generator().manual_seed(0), alpha=1.5, t_min=1e-3)
    assert 1e-3 <= t.min() and t.max() <= 1.0
    b = (t - 1e-3) / (1 - 1e-3)
    for x in (0.1, 0.3, 0.5, 0.7, 0.9):                      # the Beta(1.5, 1) CDF is x ** 1.5
        assert abs((b <= x).float().mean().item() - x ** 1.5) < 0.005, x
    again = F.sample_time((200_000,), torch.Generator().manual_seed(0), alpha=1.5, t_min=1e-3)
    assert torch.equal(t, again)


def test_interpolation_and_loss_match_a_naive_loop():
    g = torch.Generator().manual_seed(1)
    a, eps, t = torch.randn(5, 3, 2, generator=g), torch.randn(5, 3, 2, generator=g), torch.rand(5, generator=g)
    v = torch.randn(5, 3, 2, generator=g)
    x, target = F.interpolate(a, eps, t)
    total = 0.0
    for i in range(5):
        for k in range(3):
            for d in range(2):
                ti = t[i].item()
                assert x[i, k, d].item() == pytest.approx(ti * eps[i, k, d].item() + (1 - ti) * a[i, k, d].item(), abs=1e-6)
                assert target[i, k, d].item() == pytest.approx(eps[i, k, d].item() - a[i, k, d].item(), abs=1e-6)
                total += (v[i, k, d].item() - (eps[i, k, d].item() - a[i, k, d].item())) ** 2
    assert F.flow_matching_loss(v, a, eps).item() == pytest.approx(total / 30, rel=1e-5)


def naive_sde_step(x, v, t, t_next, noise_level, t_cap):
    sigma = noise_level * math.sqrt(t / (1 - min(t, t_cap)))      # t = 1 keeps its numerator
    d = t - t_next
    x0, x1 = x - t * v, x + (1 - t) * v
    return x0 * (1 - t + d) + x1 * (t - d - sigma ** 2 * d / (2 * t)), sigma * math.sqrt(d)


@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_flow_sde_step_matches_a_naive_loop_and_is_euler_at_noise_level_0(num_steps):
    g = torch.Generator().manual_seed(num_steps)
    grid = F.time_grid(num_steps)
    t_cap = grid[1].item()
    for i in range(num_steps):
        t, t_next = grid[i].item(), grid[i + 1].item()
        x, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
        mean, std = F.sde_step(x, v, t, t_next, 0.5, t_cap)
        for j in range(3):
            for k in range(4):
                m, s = naive_sde_step(x[j, k].item(), v[j, k].item(), t, t_next, 0.5, t_cap)
                assert mean[j, k].item() == pytest.approx(m, abs=1e-5)
                assert std[j, k].item() == pytest.approx(s, abs=1e-6)
        if i == 0:           # Flow-GRPO's anchor: sigma_1 = a sqrt(1 / (1 - t_1)) = a sqrt(N) on this grid
            assert F.sde_sigma(t, 0.5, t_cap).item() == pytest.approx(0.5 * math.sqrt(num_steps), rel=1e-6)
        mean0, std0 = F.sde_step(x, v, t, t_next, 0.0, t_cap)
        torch.testing.assert_close(mean0, F.ode_step(x, v, t, t_next), atol=1e-6, rtol=0)
        assert torch.all(std0 == 0)


def test_flow_sde_keeps_the_marginals_of_the_ode():
    """With the exact velocity of a Gaussian target N(m, s^2), Euler and Flow-SDE sampling both end
    at N(m, s^2): the SDE's drift correction (sigma^2 d / 2t) exactly offsets its noise. Without it
    the samples would spread wider."""
    m, s, n_steps = 0.3, 0.2, 200

    def velocity(x, t):                     # E[eps - a | x_t = x] for a ~ N(m, s^2), eps ~ N(0, 1)
        return -m + (t - (1 - t) * s ** 2) / (t ** 2 + (1 - t) ** 2 * s ** 2) * (x - (1 - t) * m)

    grid = F.time_grid(n_steps)
    for noise_level in (0.0, 0.5):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(100_000, generator=g)
        for i in range(n_steps):
            t, t_next = grid[i].item(), grid[i + 1].item()
            mean, std = F.sde_step(x, velocity(x, t), t, t_next, noise_level, grid[1].item())
            x = mean + std * torch.randn(x.shape, generator=g)
        assert abs(x.mean().item() - m) < 0.005 and abs(x.std().item() - s) < 0.005, (noise_level, x.mean(), x.std())


def test_gaussian_logprob_and_entropy_match_torch_distributions():
    g = torch.Generator().manual_seed(2)
    x, mean = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    std = torch.rand(4, 5, generator=g) + 0.05
    normal = torch.distributions.Normal(mean, std)
    torch.testing.assert_close(F.gaussian_logprob(x, mean, std), normal.log_prob(x), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(F.gaussian_entropy(std), normal.entropy(), atol=1e-6, rtol=1e-6)


def test_bounded_log_std_stays_in_its_range():
    raw = torch.tensor([-1e4, -3.0, 0.0, 3.0, 1e4])
    out = F.bounded_log_std(raw, -5.0, -1.0)
    assert out.min() >= -5.0 and out.max() <= -1.0 and out[2].item() == pytest.approx(-3.0)
    assert torch.all(out[1:] >= out[:-1])                    # monotone
    with pytest.raises(ValueError, match="log_std_min=-1.0 must be < log_std_max=-5.0"):
        F.bounded_log_std(raw, -1.0, -5.0)


@pytest.mark.parametrize("level", LOGPROB_LEVELS)
def test_aggregation_averages_the_steps_then_sums_like_the_token_heads(level):
    B, S, K, D = 2, 3, 4, 2
    step_logp = torch.randn(B, S, K, D, generator=torch.Generator().manual_seed(3))
    out = F.aggregate_steps(step_logp, level)
    expect = []
    for b in range(B):
        per = [[sum(step_logp[b, s, k, d].item() for s in range(S)) / S for d in range(D)] for k in range(K)]
        if level == "token_level":
            expect.append([per[k][d] for k in range(K) for d in range(D)])
        elif level == "action_level":
            expect.append([sum(per[k]) for k in range(K)])
        else:
            expect.append([sum(sum(row) for row in per)])
    torch.testing.assert_close(out, torch.tensor(expect), atol=1e-5, rtol=0)


def test_flow_matching_sft_on_a_toy_1d_target_is_reproduced_by_the_sampler():
    """A small velocity MLP trained with the flow-matching loss on a two-mode 1-D target; its
    10-step Euler and Flow-SDE samplers land on the modes, in the right shares. The untrained
    network does not, so the check can fail."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                              torch.nn.Linear(64, 1))

    def sample(noise_level, n_steps=10, n=4000):
        grid, x = F.time_grid(n_steps), torch.randn(n, 1, generator=g)
        with torch.no_grad():
            for i in range(n_steps):
                t, t_next = grid[i].item(), grid[i + 1].item()
                mean, std = F.sde_step(x, net(torch.cat([x, torch.full_like(x, t)], -1)), t, t_next, noise_level,
                                       grid[1].item())
                x = mean + std * torch.randn(x.shape, generator=g)
        on_a_mode = (((x - 0.6).abs() < 0.15) | ((x + 0.6).abs() < 0.15)).float().mean().item()
        return on_a_mode, (x > 0).float().mean().item()

    assert sample(0.0)[0] < 0.6                                   # untrained
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(1500):
        a = torch.where(torch.rand(256, 1, generator=g) < 0.5, -0.6, 0.6) + 0.03 * torch.randn(256, 1, generator=g)
        eps, t = torch.randn(a.shape, generator=g), F.sample_time((256,), g)
        x_t, _ = F.interpolate(a, eps, t)
        loss = F.flow_matching_loss(net(torch.cat([x_t, t[:, None]], -1)), a, eps)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for noise_level in (0.0, 0.5):
        on_a_mode, positive = sample(noise_level)
        assert on_a_mode > 0.85 and 0.4 < positive < 0.6, (noise_level, on_a_mode, positive)
