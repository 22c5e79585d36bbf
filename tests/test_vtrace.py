"""V-trace against the paper's formula written as a naive double loop, plus its limiting cases."""

import math

import pytest
import torch

from asyncvla.common.advantages.vtrace import VTraceReturns, vtrace
from asyncvla.learner.rewards import bootstrap_truncated, chunk_rewards

# float32 runs the backward recursion in single precision over up to 33 steps with O(1..10)
# values: errors up to ~2e-6 are seen here, so it is held to 1e-5 (float64: 1e-6, seen ~4e-15).
TOL = {torch.float64: 1e-6, torch.float32: 1e-5}


def random_segment(T, B, dtype, seed, M=None, gamma=0.9, p_end=0.2):
    g = torch.Generator().manual_seed(seed)
    shape = (T, B) if M is None else (T, B, M)
    # log-ratios spread so that ρ falls on both sides of every clip threshold tested
    behavior = -torch.rand(shape, generator=g, dtype=torch.float64) * 2
    target = behavior + torch.randn(shape, generator=g, dtype=torch.float64) * (0.8 if M is None else 0.4)
    ends = torch.rand(T, B, generator=g, dtype=torch.float64) < p_end
    seg = dict(behavior_logp=behavior, target_logp=target,
               rewards=torch.randn(T, B, generator=g, dtype=torch.float64),
               values=torch.randn(T, B, generator=g, dtype=torch.float64) * 3,
               bootstrap_value=torch.randn(B, generator=g, dtype=torch.float64) * 3,
               discounts=gamma * (~ends).double())
    return {k: v.to(dtype) for k, v in seg.items()}


def naive_vtrace(seg, rho_bar, c_bar, lam):
    """v_s = V(x_s) + Σ_{t=s}^{T-1} (Π_{i=s}^{t-1} γ_i c_i) δ_t, element by element in python floats."""
    lp = (seg["target_logp"].double() - seg["behavior_logp"].double())
    if lp.dim() == 3:
        lp = lp.sum(-1)
    r, V, boot, gam = (seg[k].double().tolist()
                       for k in ("rewards", "values", "bootstrap_value", "discounts"))
    T, B = len(r), len(r[0])
    vs = [[0.0] * B for _ in range(T)]
    adv = [[0.0] * B for _ in range(T)]
    for b in range(B):
        rho = [math.exp(lp[t, b].item()) for t in range(T)]
        Vb = [V[t][b] for t in range(T)] + [boot[b]]
        delta = [min(rho_bar, rho[t]) * (r[t][b] + gam[t][b] * Vb[t + 1] - Vb[t]) for t in range(T)]
        for s in range(T):
            total = Vb[s]
            for t in range(s, T):
                coef = 1.0
                for i in range(s, t):
                    coef *= gam[i][b] * lam * min(c_bar, rho[i])
                total += coef * delta[t]
            vs[s][b] = total
        for s in range(T):
            v_next = vs[s + 1][b] if s + 1 < T else boot[b]
            adv[s][b] = min(rho_bar, rho[s]) * (r[s][b] + gam[s][b] * v_next - Vb[s])
    return torch.tensor(vs, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("rho_bar,c_bar,lam", [(1.0, 1.0, 1.0), (0.5, 2.0, 0.9), (2.0, 0.5, 0.5),
                                               (1.0, 1.0, 0.0)])
def test_matches_naive_double_loop(dtype, T, rho_bar, c_bar, lam):
    seg = random_segment(T, 4, dtype, seed=T * 7 + int(10 * lam))
    assert (seg["discounts"] == 0).any() or T == 1      # episode ends inside the segment
    out = vtrace(**seg, rho_bar=rho_bar, c_bar=c_bar, lam=lam)
    ref_vs, ref_adv = naive_vtrace(seg, rho_bar, c_bar, lam)
    assert isinstance(out, VTraceReturns) and out.vs.dtype == dtype
    assert (out.vs.double() - ref_vs).abs().max() <= TOL[dtype]
    assert (out.pg_advantages.double() - ref_adv).abs().max() <= TOL[dtype]
    rhos = torch.exp(seg["target_logp"].double() - seg["behavior_logp"].double())
    assert torch.allclose(out.rhos.double(), rhos, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_level_logprobs_sum_into_one_step_ratio(dtype):
    seg = random_segment(6, 3, dtype, seed=1, M=5)
    out = vtrace(**seg, rho_bar=1.2, c_bar=0.8, lam=0.95)
    reduced = dict(seg, behavior_logp=seg["behavior_logp"].sum(-1), target_logp=seg["target_logp"].sum(-1))
    ref = vtrace(**reduced, rho_bar=1.2, c_bar=0.8, lam=0.95)
    ref_vs, ref_adv = naive_vtrace(seg, 1.2, 0.8, 0.95)
    assert out.rhos.shape == (6, 3)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=TOL[dtype])
    assert (out.vs.double() - ref_vs).abs().max() <= TOL[dtype]
    assert (out.pg_advantages.double() - ref_adv).abs().max() <= TOL[dtype]


def lambda_return(r, V, boot, gam, lam):
    """G^λ_s = (1−λ) Σ_{n<N} λ^{n-1} G^(n)_s + λ^{N-1} G^(N)_s, N = T − s, from n-step returns."""
    T, B = r.shape
    Vx = torch.cat([V, boot[None]])
    out = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        for s in range(T):
            N = T - s

            def G(n):
                total, disc = 0.0, 1.0
                for k in range(n):
                    total += disc * r[s + k, b].item()
                    disc *= gam[s + k, b].item()
                return total + disc * Vx[s + n, b].item()

            out[s, b] = (1 - lam) * sum(lam ** (n - 1) * G(n) for n in range(1, N)) + lam ** (N - 1) * G(N)
    return out


@pytest.mark.parametrize("lam", [1.0, 0.9, 0.5, 0.0])
def test_on_policy_is_the_lambda_return(lam):
    seg = random_segment(9, 3, torch.float64, seed=3)
    seg["target_logp"] = seg["behavior_logp"].clone()
    out = vtrace(**seg, rho_bar=1e9, c_bar=1e9, lam=lam)
    ref = lambda_return(seg["rewards"], seg["values"], seg["bootstrap_value"], seg["discounts"], lam)
    assert torch.allclose(out.vs, ref, atol=1e-9, rtol=0)
    assert torch.equal(out.rhos, torch.ones(9, 3, dtype=torch.float64))


def test_on_policy_lambda_one_is_the_discounted_return_bootstrapped_at_the_end():
    seg = random_segment(7, 2, torch.float64, seed=4)
    seg["target_logp"] = seg["behavior_logp"].clone()
    out = vtrace(**seg, rho_bar=1e9, c_bar=1e9, lam=1.0)
    r, gam, boot = seg["rewards"], seg["discounts"], seg["bootstrap_value"]
    ret = torch.zeros(7, 2, dtype=torch.float64)
    for b in range(2):
        for s in range(7):
            total, disc = 0.0, 1.0
            for t in range(s, 7):
                total += disc * r[t, b].item()
                disc *= gam[t, b].item()
            ret[s, b] = total + disc * boot[b].item()
    assert torch.allclose(out.vs, ret, atol=1e-9, rtol=0)
    assert torch.allclose(out.pg_advantages, ret - seg["values"], atol=1e-9, rtol=0)


def test_rho_above_rho_bar_is_clipped_in_the_advantages():
    seg = random_segment(4, 2, torch.float64, seed=5)
    seg["target_logp"] = seg["behavior_logp"] + math.log(5.0)          # ρ = 5 everywhere
    seg["target_logp"][:, 1] = seg["behavior_logp"][:, 1] + math.log(0.5)   # ρ = 0.5 in column 1
    clipped = vtrace(**seg, rho_bar=1.5, c_bar=1.0)
    free = vtrace(**seg, rho_bar=1e9, c_bar=1.0)
    # last step: v_{s+1} is the bootstrap value in both, so only the weight differs
    assert torch.allclose(clipped.pg_advantages[-1, 0], free.pg_advantages[-1, 0] * 1.5 / 5.0)
    assert torch.allclose(clipped.pg_advantages[:, 1], free.pg_advantages[:, 1])   # ρ < ρ̄: untouched
    vs_next = torch.cat([clipped.vs[1:], seg["bootstrap_value"][None]])
    td = seg["rewards"] + seg["discounts"] * vs_next - seg["values"]
    assert torch.allclose(clipped.pg_advantages[:, 0], 1.5 * td[:, 0])
    assert torch.allclose(clipped.rhos[:, 0], torch.full((4,), 5.0, dtype=torch.float64))   # unclipped


def test_c_bar_changes_only_the_traces():
    seg = random_segment(8, 3, torch.float64, seed=6, p_end=0.0)
    seg["target_logp"] = seg["behavior_logp"] + 0.7                    # ρ ≈ 2 > every c̄ below
    low, high = vtrace(**seg, rho_bar=3.0, c_bar=0.3), vtrace(**seg, rho_bar=3.0, c_bar=1.5)
    assert not torch.allclose(low.vs[:-1], high.vs[:-1])               # traces cut differently
    assert torch.allclose(low.vs[-1], high.vs[-1])                     # no trace at the last step
    assert torch.allclose(low.pg_advantages[-1], high.pg_advantages[-1])
    for out in (low, high):   # the advantage weights are min(ρ̄, ρ) whatever c̄ is
        vs_next = torch.cat([out.vs[1:], seg["bootstrap_value"][None]])
        td = seg["rewards"] + seg["discounts"] * vs_next - seg["values"]
        assert torch.allclose(out.pg_advantages, torch.exp(torch.tensor(0.7, dtype=torch.float64)) * td)


def test_no_gradient_flows_out():
    seg = random_segment(5, 2, torch.float32, seed=7)
    seg = {k: v.requires_grad_() for k, v in seg.items()}
    with torch.enable_grad():
        out = vtrace(**seg)
    for x in out:
        assert not x.requires_grad and x.grad_fn is None


def test_truncation_bootstraps_from_the_final_observation_not_the_next_episode():
    T, B, gamma = 4, 2, 0.9
    rewards = torch.tensor([[1.0, 0.5], [2.0, 0.5], [0.3, 0.5], [0.1, 0.5]], dtype=torch.float64)
    terminated = torch.zeros(T, B, dtype=torch.bool)
    truncated = torch.zeros(T, B, dtype=torch.bool)
    truncated[1, 0] = True                        # env 0 hits its time limit at t=1 and auto-resets
    terminated[2, 1] = truncated[2, 1] = True     # terminal and truncated at once: no bootstrap
    final_values = torch.full((T, B), float("nan"), dtype=torch.float64)
    final_values[1, 0] = 3.0
    final_values[2, 1] = 100.0
    r, disc = bootstrap_truncated(rewards, gamma, terminated, truncated, final_values)
    assert r[1, 0] == 2.0 + gamma * 3.0 and r[2, 1] == 0.5
    assert torch.isfinite(r).all()                # placeholders outside truncations never leak
    assert disc[1, 0] == 0 and disc[2, 1] == 0 and disc[0, 0] == gamma

    logp = torch.zeros(T, B, dtype=torch.float64)
    results = []
    for next_episode_value in (-1e3, 1e3):        # V of the new episode's first observation
        values = torch.tensor([[0.2, 0.1], [0.4, 0.1], [next_episode_value, 0.1], [0.0, 0.1]],
                              dtype=torch.float64)
        out = vtrace(logp, logp + 0.3, r, values, torch.tensor([0.5, 0.5], dtype=torch.float64), disc,
                     rho_bar=1.0, c_bar=1.0, lam=1.0)
        results.append(out)
        # off-policy (ρ clipped to 1): target of the truncated step is r + γ·V(final) exactly
        assert out.vs[1, 0] == pytest.approx(2.0 + gamma * 3.0)
        assert out.pg_advantages[1, 0] == pytest.approx(2.0 + gamma * 3.0 - 0.4)
    assert results[0].vs[1, 0] == results[1].vs[1, 0]
    assert torch.equal(results[0].vs[:2], results[1].vs[:2])   # nothing before the reset depends on it


def test_chunk_rewards_discount_inside_the_chunk():
    g = torch.Generator().manual_seed(8)
    rewards = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    rewards[1, 0, 2:] = 0.0                       # episode ended after two env steps of this chunk
    out = chunk_rewards(rewards, 0.95)
    for t in range(3):
        for b in range(2):
            ref = sum(0.95 ** k * rewards[t, b, k].item() for k in range(4))
            assert out[t, b].item() == pytest.approx(ref)
    assert torch.allclose(chunk_rewards(rewards, 1.0), rewards.sum(-1))
    with pytest.raises(ValueError, match="action_level"):
        chunk_rewards(rewards[..., 0], 0.9)


def test_shape_errors_name_the_argument():
    seg = random_segment(3, 2, torch.float64, seed=9)
    with pytest.raises(ValueError, match="bootstrap_value"):
        vtrace(**dict(seg, bootstrap_value=seg["bootstrap_value"][:1]))
    with pytest.raises(ValueError, match="discounts"):
        vtrace(**dict(seg, discounts=seg["discounts"][:2]))
    with pytest.raises(ValueError, match="lam=1.5"):
        vtrace(**seg, lam=1.5)
