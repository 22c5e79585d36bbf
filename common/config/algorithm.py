"""algorithm: the advantages and the PPO loss, and the checks that tie them to other sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .fields import opt

if TYPE_CHECKING:
    from .schema import Config


@dataclass
class AlgorithmConfig:
    adv_type: str = opt("vtrace", "how a step's advantage is estimated (common/advantages/, one file "
                        "each): vtrace (the critic's off-policy-corrected V-trace targets, PPO with a "
                        "value loss), gae (the critic's GAE, stale data taken as on-policy) or grpo "
                        "(critic-free, group-relative: algorithm.group_size episodes start from one "
                        "initial state and each episode's return is compared with its group's)",
                        choices=["vtrace", "gae", "grpo"])
    group_size: int = opt(8, "grpo: episodes per group, started from one initial state (an actor's envs "
                          "take a group's episodes in turn)", ge=2)
    gamma: float = opt(0.99, "discount per policy step (per chunk with reward_type chunk_level)",
                       ge=0.0, le=1.0)
    vtrace_lambda: float = opt(1.0, "V-trace lambda (trace cutting, like GAE's lambda)", ge=0.0, le=1.0)
    gae_lambda: float = opt(0.95, "gae: GAE's lambda (0: one-step advantages, 1: Monte Carlo returns "
                            "minus V)", ge=0.0, le=1.0)
    off_policy_correction: str = opt("vtrace", "adv_type vtrace: importance-weighted targets and advantages "
                                     "for data from older policies; none: treat stale data as on-policy "
                                     "(λ-returns and GAE; the PPO ratio is still π/μ) — the ablation",
                                     choices=["vtrace", "none"])
    rho_bar: float = opt(1.0, "V-trace clip of importance weights in targets/advantages", gt=0.0)
    c_bar: float = opt(1.0, "V-trace clip of the traces", gt=0.0)
    policy_loss: str = opt("behavior_clip", "PPO objective: behavior_clip clips pi/mu around the behaviour "
                           "policy mu; decoupled clips pi/pi_prox around the learner's weights at the "
                           "update's start and weights each element by pi_prox/mu (masked above "
                           "behave_weight_threshold), so stale data does not cut the step short",
                           choices=["behavior_clip", "decoupled"])
    behave_weight_threshold: float = opt(2.0, "decoupled loss: elements whose behaviour weight pi_prox/mu "
                                         "exceeds this are masked out", gt=1.0)
    ratio_clip_eps: float = opt(0.2, "PPO clip epsilon of the ratio (pi/mu, or pi/pi_prox when decoupled)",
                                gt=0.0)
    clip_ratio_c: Optional[float] = opt(None, "dual-clip constant c (> 1) for negative advantages; "
                                        "null disables", gt=1.0)
    entropy_bonus: float = opt(0.0, "entropy coefficient", ge=0.0)
    value_loss_coef: float = opt(0.5, "weight of the value loss", ge=0.0)
    value_loss_type: str = opt("mse", "value loss", choices=["mse", "huber"])
    huber_delta: float = opt(1.0, "Huber loss delta", gt=0.0)
    value_clip: Optional[float] = opt(None, "clip new values to old +- this (null disables)", gt=0.0)
    value_norm: bool = opt(False, "the value head predicts returns normalised by a running mean and std of "
                           "the V-trace targets (learner/value_norm.py): the value loss stays O(1) at any "
                           "reward scale, so its gradient cannot swamp the policy's in the global "
                           "gradient-norm clip (learner.clip_grad)")
    value_norm_decay: float = opt(0.99, "decay per learner update of value_norm's running statistics",
                                  ge=0.0, lt=1.0)
    value_augment_shift: int = opt(0, "random-shift augmentation of the critic's image in the PPO epochs "
                                   "(DrQ): pad by this many edge pixels, crop back at a random offset. The "
                                   "policy's image and the V-trace targets are not shifted. Needs "
                                   "policy.value_encoder cnn (a critic that reads the image)", ge=0)
    normalize_advantages: bool = opt(True, "normalise advantages per batch")
    advantage_scale: float = opt(1.0, "multiply advantages by this after normalisation", gt=0.0)
    update_epochs: int = opt(1, "passes over each batch", ge=1)
    num_minibatches: int = opt(1, "minibatches per pass (per rank)", ge=1)
    reward_type: str = opt("chunk_level", "chunk_level: one reward per action chunk (sum over its "
                           "steps); action_level: one per env step", choices=["chunk_level", "action_level"])
    logprob_type: str = opt("token_level", "granularity of log-probs and ratios",
                            choices=["token_level", "action_level", "chunk_level"])


def check_value_augment(config: "Config") -> list[str]:
    shift, encoder = config.algorithm.value_augment_shift, config.policy.value_encoder
    if shift and encoder != "cnn":
        return [f"algorithm.value_augment_shift={shift} shifts the image of a critic that reads it; "
                f"policy.value_encoder={encoder!r} does not: set policy.value_encoder=cnn or the shift to 0"]
    return []


def check_estimator(config: "Config") -> list[str]:
    """The rules the chosen advantage estimator sets on the rest of the config (common/advantages/)."""
    from asyncvla.common.advantages import ESTIMATORS   # (loads numpy: only once the fields are read)
    est = ESTIMATORS.get(config.algorithm.adv_type)   # (an unknown one: check_field has said so)
    return est(config.algorithm).config_problems(config) if est else []
