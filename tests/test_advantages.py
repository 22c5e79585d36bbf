"""The advantage estimators' registry (common/advantages/) and GAE against the paper's recursion
written as a naive loop. V-trace's own reference tests are tests/test_vtrace.py, GRPO's
tests/test_groups.py; all three on a ZeRO-3 engine: tests/test_update.py."""

import dataclasses
import re

import pytest
import torch

from asyncvla.common.advantages import ESTIMATORS, TargetInputs, make_estimator
from asyncvla.common.advantages.gae import gae
from asyncvla.common.advantages.vtrace import vtrace
from asyncvla.common.config import AlgorithmConfig, load_config
from tests.support.paths import PIXEL, REPO


def random_segment(T, B, seed, p_end=0.25, gamma=0.9):
    g = torch.Generator().manual_seed(seed)
    ends = torch.rand(T, B, generator=g, dtype=torch.float64) < p_end
    return dict(rewards=torch.randn(T, B, generator=g, dtype=torch.float64),
                values=torch.randn(T, B, generator=g, dtype=torch.float64) * 2,
                bootstrap_value=torch.randn(B, generator=g, dtype=torch.float64) * 2,
                discounts=gamma * (~ends).double())


def naive_gae(seg, lam):
    """A_t = Σ_k (Π_{j<k} γ_{t+j} λ) δ_{t+k}, one (t, b) at a time, as the sum the recursion unrolls."""
    r, v, d = seg["rewards"].tolist(), seg["values"].tolist(), seg["discounts"].tolist()
    T, B = len(r), len(r[0])
    out = [[0.0] * B for _ in range(T)]
    for b in range(B):
        def value(t):
            return v[t][b] if t < T else float(seg["bootstrap_value"][b])
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                total += weight * (r[k][b] + d[k][b] * value(k + 1) - value(k))
                weight *= d[k][b] * lam
            out[t][b] = total
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("T,lam", [(1, 0.95), (7, 0.0), (7, 0.95), (16, 1.0), (16, 0.5)])
def test_gae_matches_the_unrolled_sum(T, lam):
    seg = random_segment(T, 5, seed=T)
    torch.testing.assert_close(gae(lam=lam, **seg), naive_gae(seg, lam), rtol=1e-10, atol=1e-10)


def test_gae_limits_one_step_td_and_monte_carlo():
    seg = random_segment(9, 3, seed=1, p_end=0.0)
    v_next = torch.cat([seg["values"][1:], seg["bootstrap_value"][None]])
    td = seg["rewards"] + seg["discounts"] * v_next - seg["values"]
    torch.testing.assert_close(gae(lam=0.0, **seg), td)
    ret, mc = seg["bootstrap_value"].clone(), torch.empty_like(td)   # λ = 1: discounted return − V
    for t in reversed(range(9)):
        ret = seg["rewards"][t] + seg["discounts"][t] * ret
        mc[t] = ret - seg["values"][t]
    torch.testing.assert_close(gae(lam=1.0, **seg), mc)


def test_gae_is_not_vtrace_on_policy_but_shares_its_value_targets():
    """On-policy V-trace (ρ = 1, c = λ) has GAE's value targets; its advantages differ unless λ = 1."""
    seg = random_segment(8, 4, seed=3)
    logp = torch.zeros(8, 4, dtype=torch.float64)
    for lam in (0.8, 1.0):
        vt = vtrace(behavior_logp=logp, target_logp=logp, lam=lam, **seg)
        adv = gae(lam=lam, **seg)
        torch.testing.assert_close(adv + seg["values"], vt.vs)
        assert torch.allclose(adv, vt.pg_advantages) == (lam == 1.0)


def test_gae_refuses_bad_shapes_and_lambda():
    seg = random_segment(4, 2, seed=0)
    with pytest.raises(ValueError, match="bootstrap_value"):
        gae(**{**seg, "bootstrap_value": torch.zeros(3)}, lam=0.9)
    with pytest.raises(ValueError, match="lam=1.5"):
        gae(**seg, lam=1.5)


def test_the_gae_estimator_uses_the_critic_and_weighs_nothing_by_the_ratio():
    seg = random_segment(6, 3, seed=5)
    behavior = -torch.rand(6, 3, 4, dtype=torch.float64)
    target = behavior + 0.3
    values = torch.cat([seg["values"], seg["bootstrap_value"][None]])
    est = make_estimator(AlgorithmConfig(adv_type="gae", gae_lambda=0.9))
    t = est.targets(TargetInputs(behavior, target, seg["rewards"], seg["discounts"], values, {}))
    torch.testing.assert_close(t.advantages, gae(lam=0.9, **seg))
    torch.testing.assert_close(t.value_targets, t.advantages + seg["values"])
    torch.testing.assert_close(t.rhos, torch.full((6, 3), 1.2, dtype=torch.float64).exp())   # 4 parts × 0.3
    assert est.critic and est.renormalize and est.episodes_per_start == 1 and not est.segment_fields()


def test_the_registry_is_the_configs_choices_and_names_them_on_a_bad_one():
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(AlgorithmConfig)}["adv_type"]
    assert set(ESTIMATORS) == set(choices) == {"vtrace", "gae", "grpo"}
    with pytest.raises(ValueError, match=r"algorithm.adv_type='td' is not allowed; choose one of \['gae', 'grpo', 'vtrace'\]"):
        make_estimator(AlgorithmConfig(adv_type="td"))
    grpo = make_estimator(load_config(PIXEL, ["algorithm.adv_type=grpo", "algorithm.group_size=4"]).algorithm)
    assert not grpo.critic and not grpo.renormalize and grpo.episodes_per_start == 4
    assert set(grpo.segment_fields()) == {"advantage", "advantage_mask"} and grpo.make_outbox().needs_slots


def test_grpo_refuses_retried_starts_itself():
    with pytest.raises(Exception, match=r"env.retry_failed_starts=0.5 cannot be used with algorithm.adv_type=grpo"):
        load_config(PIXEL, ["algorithm.adv_type=grpo", "env.retry_failed_starts=0.5"])


def test_nothing_outside_the_registry_branches_on_adv_type():
    """An estimator is one file: actors, learner, protocol and envs ask it, never the config's name."""
    branch = re.compile(r"adv_type\s*(==|!=|\bin\b|\bnot in\b)|==\s*[\"'](grpo|gae|vtrace)[\"']")
    found = [f"{p.relative_to(REPO)}:{i}" for d in ("actors", "learner", "common", "launch")
             for p in sorted((REPO / d).rglob("*.py")) if "advantages" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert found == [], found
