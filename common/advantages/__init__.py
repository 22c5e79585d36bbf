"""Advantage estimators: how a policy step's advantage is computed, one file each.

    est = make_estimator(cfg.algorithm)        # the one algorithm.adv_type names
    est.config_problems(cfg)                   # its own rules on the rest of the config
    est.episodes_per_start                     # GRPO: G episodes start from one initial state
    outbox = est.make_outbox()                 # actors: what to hold back before sending
    est.segment_fields()                       # what it needs in a segment beyond the steps
    targets = est.targets(inputs)              # learner: advantages, value targets, weights

An estimator runs on the learner (V-trace, GAE: from the critic's values on the batch) or on the
actors (GRPO: from the returns of groups of episodes, sent with each step). It says what the learner
need not compute (`critic` False: no truncation bootstraps, no value targets, no value loss) and
whether the loss may normalise its advantages again (`renormalize`). Nothing outside this package
tests algorithm.adv_type: add an estimator as one file here that subclasses Estimator, decorate it
with @register, and import it at the bottom of this file (and name it in the config's choices,
common/config/algorithm.py, which a test compares with ESTIMATORS).

The estimator files import torch inside their functions: config checks load them, and loading a
config must not load torch (the launcher refuses a bad config in a fraction of a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:
    import torch


class TargetInputs(NamedTuple):
    """What the learner knows of a batch before the PPO epochs, per policy step ([T, N] unless said).
    behavior_logp, target_logp: log μ and log π_θ of the steps taken, [T, N] or [T, N, M];
    rewards, discounts: after the truncation bootstraps (learner/rewards.py); values
    [T + 1, N]: the critic's V on every observation and the one after the segment (None without a
    critic); arrays: the segment arrays the actors sent (an actor-side estimator's fields)."""
    behavior_logp: "torch.Tensor"
    target_logp: "torch.Tensor"
    rewards: Optional["torch.Tensor"]
    discounts: Optional["torch.Tensor"]
    values: Optional["torch.Tensor"]
    arrays: dict


class Targets(NamedTuple):
    """advantages, value_targets (None without a critic), rhos (π/μ per policy step), mask (1: the
    step trains), stats (name -> float, for tensorboard)."""
    advantages: "torch.Tensor"
    value_targets: Optional["torch.Tensor"]
    rhos: "torch.Tensor"
    mask: "torch.Tensor"
    stats: dict


class Outbox:
    """What an actor sends of its segments: each as it comes (an estimator that scores segments on the
    actors holds them back until it can: grpo.py's GroupOutbox)."""
    needs_slots = False          # (collect_segment's `slots`: which episode each step belongs to)

    def add(self, meta: dict, arrays: dict, info: dict) -> list[tuple[dict, dict]]:
        return [(meta, arrays)]

    @property
    def held(self) -> int:
        return 0


class Estimator:
    """The base: a learner-side estimator with a critic and nothing in the segments. `alg` is the
    AlgorithmConfig."""
    name = ""
    critic = True                # the learner runs the value head's targets and loss
    renormalize = True           # algorithm.normalize_advantages may normalise them per minibatch

    def __init__(self, alg):
        self.alg = alg

    def config_problems(self, config) -> list[str]:
        """Its rules on the whole config (a Config), each a one-line message naming the keys."""
        return []

    @property
    def episodes_per_start(self) -> int:
        """How many consecutive episodes of an actor start from one initial state."""
        return 1

    def make_outbox(self) -> Outbox:
        return Outbox()

    def segment_fields(self) -> dict:
        """Arrays a segment carries for it: name -> common.transport.protocol Field."""
        return {}

    def segment_bounds(self) -> dict:
        """Bounds of those arrays: Field.bound name -> (low, high, reason)."""
        return {}

    def targets(self, x: TargetInputs) -> Targets:
        raise NotImplementedError


ESTIMATORS: dict[str, type] = {}


def register(estimator: type) -> type:
    """Class decorator: make `estimator` available as algorithm.adv_type=estimator.name."""
    ESTIMATORS[estimator.name] = estimator
    return estimator


def make_estimator(alg) -> Estimator:
    """The estimator algorithm.adv_type names (ValueError naming the allowed ones otherwise)."""
    if alg.adv_type not in ESTIMATORS:
        raise ValueError(f"algorithm.adv_type={alg.adv_type!r} is not allowed; choose one of {list(ESTIMATORS)}")
    return ESTIMATORS[alg.adv_type](alg)


def step_log_ratio(behavior_logp: "torch.Tensor", target_logp: "torch.Tensor") -> "torch.Tensor":
    """log π/μ of each policy step [T, N]: the sum over its M parts when the log-probs are [T, N, M]
    (the step's probability is the product of its parts')."""
    log_rhos = target_logp.detach() - behavior_logp.detach()
    return log_rhos.sum(-1) if log_rhos.dim() == 3 else log_rhos


# The estimators, each registering itself (after the base above, which they import).
from . import gae, grpo, vtrace  # noqa: E402,F401
