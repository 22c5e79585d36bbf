"""One learner update on a batch: recompute π_θ on the behaviour data, the advantages, PPO epochs.

Every rank calls these with the same batch geometry: under ZeRO-3 each forward/backward gathers
parameters collectively, so the number of forward calls must match across ranks (hence the
padding of the truncation bootstrap observations to the largest count of any rank).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from asyncvla.common.advantages import TargetInputs, make_estimator
from asyncvla.common.config import Config
from asyncvla.common.policy import reduce_logprobs
from asyncvla.common.transport.protocol import OBS_FIELDS, final_field
from asyncvla.learner.collectives import any_rank, max_over_ranks
from asyncvla.learner.ingest import Batch
from asyncvla.learner.loss import masked_mean_std, ppo_loss_from_config
from asyncvla.learner.sft_data import random_shift
from asyncvla.learner.value_norm import ValueNorm
from asyncvla.learner.rewards import bootstrap_truncated, chunk_rewards

log = logging.getLogger("asyncvla.learner")


def step_discount(cfg: Config) -> float:
    """Discount between two policy steps. With action-level rewards γ is per env step and a policy
    step spans K env steps, so consecutive policy steps are γ^K apart."""
    g = cfg.algorithm.gamma
    return g ** cfg.policy.num_action_chunks if cfg.algorithm.reward_type == "action_level" else g


def update(engine, batch: Batch, cfg: Config, device: torch.device, step: int = 0,
           guard: "FiniteGuard | None" = None, value_norm: ValueNorm | None = None) -> dict:
    """Targets without gradient, then `update_epochs` passes of PPO over `num_minibatches`
    minibatches. `step` (the number of updates before this one) seeds the minibatch order;
    `guard` sees every optimizer step (and raises NonFiniteError to stop the run); `value_norm`
    (algorithm.value_norm) is updated with this batch's targets.

    Defence in depth: a column whose log-probs, values or targets come out non-finite (data that
    passed validation yet overflows the policy) is dropped before the PPO epochs (`drop_columns`),
    so the step stays finite and does not count as a non-finite one; the stats name the actors
    that sent such columns ("poisoned_by")."""
    targets = compute_targets(engine, batch, cfg, device, value_norm)
    poisoned = np.flatnonzero(~targets["finite_columns"].cpu().numpy())
    if len(poisoned):
        drop_columns(batch, targets, poisoned)
    stats = ppo_epochs(engine, batch, targets, cfg, device, seed=cfg.learner.seed * 1_000_003 + step,
                       guard=guard, update_number=step + 1)
    stats.update(targets["stats"])
    stats["poisoned_columns"] = float(len(poisoned))
    stats["poisoned_by"] = [batch.actors[i] for i in poisoned] if batch.actors else []
    return stats


def drop_columns(batch: Batch, targets: dict, columns) -> None:
    """Take `columns` out of training without changing the batch's shape (every rank must make the
    same forward passes): their float inputs become another, finite column's (zeros if none is),
    their targets 0, and targets["mask"] 0 there, so the loss leaves them out."""
    good = np.flatnonzero(targets["finite_columns"].cpu().numpy())
    for k, a in batch.arrays.items():
        if a.dtype.kind == "f":
            a[:, columns] = a[:, good[:1]] if len(good) else 0
    for k in ("behavior_logp", "prox_logp", "old_values", "vs", "advantages", "rhos"):
        targets[k][:, torch.as_tensor(columns)] = 0
    targets["mask"][:, torch.as_tensor(columns)] = 0


# ------------------------------------------------------------------------------- finite or stop
class NonFiniteError(RuntimeError):
    """Optimizer steps were non-finite too many times in a row: the run must stop."""


@dataclass
class FiniteGuard:
    """Optimizer steps whose loss or gradient norm was non-finite. DeepSpeed's ZeRO optimizers
    skip a step whose global gradient norm is non-finite (a non-finite loss is made to give one:
    `poisoned`), so the weights stay as they were; `max_in_a_row` such steps in a row raise
    NonFiniteError. The verdict rests on the global norm, so every rank reaches the same one."""
    max_in_a_row: int
    skipped: int = 0            # non-finite steps in the run so far
    in_a_row: int = 0

    def after_step(self, update_number: int, finite: bool, what: str) -> None:
        if finite:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(f"update {update_number}: {self.in_a_row} optimizer steps in a row were "
                                 f"non-finite (last: {what}); learner.max_nonfinite_steps={self.max_in_a_row}. "
                                 "Lower learner.lr / learner.value_lr or check the rewards")
        log.warning("update %d: optimizer step skipped: %s (%d in a row, stop at %d)", update_number, what,
                    self.in_a_row, self.max_in_a_row)


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """What to back-propagate for a non-finite loss: it times NaN, so that every gradient it reaches
    is NaN and the optimizer's global norm check skips the step on every rank (an inf loss may
    otherwise give finite gradients, and a NaN one NaN gradients only where it came from)."""
    return loss * float("nan")


def step_verdict(losses_finite: bool, loss_text: str, grad_norm, device) -> tuple[bool, str]:
    """(finite, what was not) of the optimizer step just taken, the same on every rank: the global
    gradient norm decides; where the engine keeps none, the ranks' loss checks do (one collective)."""
    if grad_norm is None:
        finite = not any_rank(not losses_finite, device)
    else:
        finite = math.isfinite(float(grad_norm))
    if finite:
        return True, ""
    return False, f"loss {loss_text}" if not losses_finite else "gradient norm non-finite"


@torch.no_grad()
def outputs_finite(engine, batch: Batch, cfg: Config, device) -> bool:
    """Whether the policy, as the last optimizer step left it, gives finite log-probs and values
    on this rank's batch (its first step's observations) on every rank: finite weights can still
    overflow the forward pass, and actors served them would sample from NaN. A collective (one
    forward pass and one all-reduce on every rank)."""
    a = batch.arrays
    rows = slice(0, min(a["terminated"].shape[1], cfg.learner.micro_batch_size))
    obs = {k: a[k][0, rows] for k in OBS_FIELDS if k in a}
    out = engine(**_inputs(obs, {k: a[k][0, rows] for k in _replay_names(engine)}, device),
                 logprob_type=cfg.algorithm.logprob_type)
    finite = bool(torch.isfinite(out.logprobs).all() and torch.isfinite(out.values).all())
    return not any_rank(not finite, device)


# ------------------------------------------------------------------------------------ targets
@torch.no_grad()
def compute_targets(engine, batch: Batch, cfg: Config, device, value_norm: ValueNorm | None = None) -> dict:
    """The behaviour and proximal log-probs of `batch`, and what its advantage estimator
    (common/advantages/, algorithm.adv_type) makes of them: advantages, value targets, importance
    weights and the steps that train. An estimator without a critic (GRPO) gets no truncation
    bootstraps and no value targets; the value loss is off for it. With `value_norm` the head's
    outputs are denormalised for the estimator, the statistics are updated with the targets, and
    the value targets and old values come back normalised by the new ones (the advantages stay in
    reward units: the loss normalises them itself)."""
    a = batch.arrays
    est = make_estimator(cfg.algorithm)
    prox_logp, v_all, final_values = _policy_outputs(engine, batch, cfg, device, finals=est.critic)
    if value_norm is not None and est.critic:
        v_all, final_values = value_norm.denormalize(v_all), value_norm.denormalize(final_values)
    behavior = reduce_logprobs(torch.from_numpy(a["behavior_logp"]).to(device), cfg.algorithm.logprob_type,
                               cfg.policy.num_action_chunks, cfg.policy.action_dim)
    rewards, discounts = _step_rewards(batch, cfg, device), None
    if est.critic:
        rewards, discounts = _bootstrapped(rewards, batch, cfg, final_values, device)
    t = est.targets(TargetInputs(behavior_logp=behavior, target_logp=prox_logp, rewards=rewards,
                                 discounts=discounts, values=v_all if est.critic else None, arrays=a))
    old_values = v_all[:-1]
    vs = t.value_targets if est.critic else old_values      # (no critic: the value loss is off)
    finite = finite_columns(prox_logp, v_all, vs, t.advantages)
    stats = {"rollout/reward_mean": float(rewards[:, finite].mean()) if finite.any() else 0.0,
             "rollout/value_mean": float(v_all[:, finite].mean()) if finite.any() else 0.0, **t.stats}
    if value_norm is not None and est.critic and finite.any():
        value_norm.update(vs[:, finite])
        old_values, vs = value_norm.normalize(old_values), value_norm.normalize(vs)
        stats.update({"train/critic/value_norm_mean": value_norm.mean, "train/critic/value_norm_std": value_norm.std})
    return {"behavior_logp": behavior, "prox_logp": prox_logp, "old_values": old_values, "vs": vs,
            "advantages": t.advantages, "rhos": t.rhos, "stats": stats, "finite_columns": finite,
            "mask": t.mask}


def _policy_outputs(engine, batch: Batch, cfg: Config, device, finals: bool = True):
    """π_θ's log-probs [T, N, M] of the steps taken, and its values on all T+1 observations [T+1, N]
    (the last only for its value) and, with `finals`, on the truncation finals [F], in micro-batches."""
    a = batch.arrays
    T, N = a["terminated"].shape[:2]
    obs = {k: _flat(a[k]) for k in OBS_FIELDS if k in a}                  # [(T+1)*N, ...]
    # (the last observation's actions: any valid ones, only V is used there; likewise for the finals)
    actions = {k: _flat(np.concatenate([a[k], a[k][-1:]])) for k in _replay_names(engine)}
    n_final = max_over_ranks(len(batch.final_index), device) if finals else 0
    if n_final:
        fin = _pad_rows({k: batch.finals[final_field(k)] for k in obs if final_field(k) in batch.finals},
                        n_final, like=obs)
        obs = {k: np.concatenate([obs[k], fin[k]]) for k in obs}
        actions = {k: np.concatenate([v, np.repeat(v[:1], n_final, axis=0)]) for k, v in actions.items()}
    logp, values = [], []
    for sl in _chunks(len(obs["image"]), cfg.learner.micro_batch_size):
        out = engine(**_inputs({k: v[sl] for k, v in obs.items()}, {k: v[sl] for k, v in actions.items()}, device),
                     logprob_type=cfg.algorithm.logprob_type)
        logp.append(out.logprobs.float())
        values.append(out.values.float())
    logp, values = torch.cat(logp), torch.cat(values)
    return (logp[: T * N].reshape(T, N, logp.shape[-1]), values[: (T + 1) * N].reshape(T + 1, N),
            values[(T + 1) * N:][: len(batch.final_index)])     # (none without `finals`)


def _step_rewards(batch: Batch, cfg: Config, device) -> torch.Tensor:
    """Rewards [T, N] per policy step: an action-level chunk's rewards discounted into one."""
    rewards = torch.from_numpy(batch.arrays["rewards"]).to(device).float()
    return chunk_rewards(rewards, cfg.algorithm.gamma) if rewards.dim() == 3 else rewards


def _bootstrapped(rewards: torch.Tensor, batch: Batch, cfg: Config, final_values: torch.Tensor, device):
    """(rewards, discounts) [T, N] with a truncated step bootstrapping from V(final observation),
    never from the next episode's first observation (see learner/rewards.py)."""
    a = batch.arrays
    terminated = torch.from_numpy(a["terminated"]).to(device)
    truncated = torch.from_numpy(a["truncated"]).to(device)
    final_v = torch.zeros_like(rewards)
    if len(batch.final_index):
        t_idx, b_idx = torch.from_numpy(batch.final_index.T).to(device)
        final_v[t_idx, b_idx] = final_values
    return bootstrap_truncated(rewards, step_discount(cfg), terminated, truncated, final_v)


def finite_columns(*per_step: torch.Tensor) -> torch.Tensor:
    """bool [N]: the columns in which every tensor ([T or T+1, N, ...] each) is finite."""
    ok = None
    for x in per_step:
        col = torch.isfinite(x).reshape(x.shape[0], x.shape[1], -1).all(-1).all(0)
        ok = col if ok is None else ok & col
    return ok


# --------------------------------------------------------------------------------------- PPO
def ppo_epochs(engine, batch: Batch, targets: dict, cfg: Config, device, seed: int = 0,
               guard: FiniteGuard | None = None, update_number: int = 0) -> dict:
    """`update_epochs` passes over the batch in `num_minibatches` shuffled minibatches (the order
    from `seed`; each rank shuffles its own columns, only the number of passes must match). After
    each minibatch's optimizer step `guard` (if any) learns whether it was finite."""
    a = batch.arrays
    T, N = a["terminated"].shape[:2]
    obs = {k: _flat(a[k][:T]) for k in OBS_FIELDS if k in a}
    actions = {k: _flat(a[k]) for k in _replay_names(engine)}
    flat = {k: targets[k].reshape(T * N, *targets[k].shape[2:])
            for k in ("behavior_logp", "prox_logp", "old_values", "vs", "advantages", "rhos", "mask")}
    alg = cfg.algorithm
    sums, count, ratio_max = defaultdict(float), 0, 0.0
    gen = torch.Generator().manual_seed(seed)
    shift_rng = np.random.default_rng(seed)       # the critic's random shifts (algorithm.value_augment_shift)
    for _ in range(alg.update_epochs):
        order = torch.randperm(T * N, generator=gen).numpy()
        for mb in np.array_split(order, alg.num_minibatches):
            micro = list(_chunks(len(mb), cfg.learner.micro_batch_size))
            # Normalise advantages over the whole minibatch (its kept steps), not per micro batch.
            mb_idx = torch.from_numpy(mb).to(device)
            adv_stats = masked_mean_std(flat["advantages"][mb_idx], flat["mask"][mb_idx])
            kept_in_mb = float(flat["mask"][mb_idx].sum())
            losses_finite, loss_text = True, ""
            for sl in micro:
                idx = mb[sl]
                inputs = _inputs({k: v[idx] for k, v in obs.items()}, {k: v[idx] for k, v in actions.items()}, device)
                if alg.value_augment_shift:
                    inputs["value_image"] = torch.from_numpy(
                        random_shift(obs["image"][idx], alg.value_augment_shift, shift_rng)).to(device)
                out = engine(**inputs, logprob_type=alg.logprob_type)
                t_idx = torch.from_numpy(idx).to(device)
                loss, stats = ppo_loss_from_config(
                    alg, new_logp=out.logprobs.float(), behavior_logp=flat["behavior_logp"][t_idx],
                    prox_logp=flat["prox_logp"][t_idx],
                    advantages=flat["advantages"][t_idx], values=out.values.float(),
                    old_values=flat["old_values"][t_idx], value_targets=flat["vs"][t_idx],
                    entropy=out.entropy.float(), rhos=flat["rhos"][t_idx], advantage_stats=adv_stats,
                    mask=flat["mask"][t_idx])
                # DeepSpeed divides by gradient_accumulation_steps (= len(micro)); re-weight uneven
                # micro batches so the minibatch loss is the mean over its kept samples.
                weight = float(flat["mask"][t_idx].sum()) * len(micro) / kept_in_mb if kept_in_mb else 0.0
                finite = bool(torch.isfinite(loss.detach()).item())
                if not finite and losses_finite:
                    losses_finite, loss_text = False, f"{loss.item():.3g}"
                engine.backward((loss if finite else poisoned(loss)) * weight)
                engine.step()
                ratio_max = max(ratio_max, stats.pop("ratio_max"))
                for k, v in stats.items():
                    sums[k] += v
                count += 1
            if guard is not None:        # (the last micro batch's step() was the optimizer step)
                guard.after_step(update_number, *step_verdict(losses_finite, loss_text, _grad_norm(engine), device))
    out = {k: v / count for k, v in sums.items()}
    out["ratio_max"] = ratio_max
    gn = _grad_norm(engine)
    if gn is not None:
        out["grad_norm"] = float(gn)
    return out


def _grad_norm(engine):
    return engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None


# ----------------------------------------------------------------------------------- helpers
def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _chunks(n: int, size: int):
    for lo in range(0, n, size):
        yield slice(lo, min(n, lo + size))


def _replay_names(engine) -> tuple:
    """The arrays that describe the policy's actions, which it scores again: its head's replay."""
    return tuple(engine.module.head.replay_fields())


def _inputs(obs: dict, replay: dict, device) -> dict:
    """The policy's named inputs (VLAPolicy.forward): the observation and the replay of its actions."""
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(device)   # noqa: E731
    return {"image": t(obs["image"]), "ids": t(obs["instruction"]), "mask": t(obs["instruction_mask"]),
            "state": t(obs["state"]) if "state" in obs else None, "replay": {k: t(v) for k, v in replay.items()}}


def _pad_rows(arrays: dict, n: int, like: dict) -> dict:
    """Pad each array to n rows (copies of the first observation of the batch when empty)."""
    out = {}
    for k, ref in like.items():
        x = arrays.get(k, ref[:0])
        filler = x[:1] if len(x) else ref[:1]
        out[k] = np.concatenate([x] + [filler] * (n - len(x))) if n > len(x) else x
    return out


