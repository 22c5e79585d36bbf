"""learner: the ZeRO-3 ranks' batch, optimiser, schedule and publishing, and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import opt


@dataclass
class LearnerConfig:
    max_steps: int = opt(200, "stop after this many learner updates", ge=1)
    max_env_steps: Optional[int] = opt(None, "also stop after this many env steps (null: no limit)", ge=1)
    max_time_s: Optional[float] = opt(None, "also stop after this many seconds of training, counted "
                                      "from the learner's first wait for data; a resumed run counts on "
                                      "from its checkpoint's, as for max_steps (null: no limit)", gt=0.0)
    target_success: Optional[float] = opt(None, "also stop once the actors' episodes succeed this often: "
                                          "the success rate over the newest learner.target_success_episodes "
                                          "episodes trained on, at or above it over two such windows in a "
                                          "row (null: no target)", gt=0.0, le=1.0)
    target_success_episodes: int = opt(128, "how many of the newest episodes learner.target_success is "
                                       "measured over (whole updates: at least this many)", ge=1)
    batch_trajectories: int = opt(8, "env trajectories of rollout_length steps in one update, across "
                                  "all ranks (a segment from an actor with B envs holds B of them)", ge=1)
    seed: int = opt(0, "seed of the learner's own randomness, the same on every rank: the initial weights "
                    "it draws beyond policy.init_seed, the minibatch order and the flow head's training noise "
                    "(actor.seed seeds the actors' sampling)", ge=0)
    micro_batch_size: int = opt(32, "samples (time steps x envs) per forward/backward on one rank", ge=1)
    lr: float = opt(1e-4, "learning rate of the policy (LoRA) parameters", gt=0.0)
    value_lr: float = opt(1e-3, "learning rate of the value head", gt=0.0)
    adam_beta1: float = opt(0.9, "Adam beta1", ge=0.0, lt=1.0)
    adam_beta2: float = opt(0.999, "Adam beta2", ge=0.0, lt=1.0)
    adam_eps: float = opt(1e-5, "Adam epsilon", gt=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    clip_grad: float = opt(1.0, "gradient-norm clip (0 disables), one norm over the policy and the value "
                           "head together: a value loss far above the policy's shrinks the policy's step "
                           "(algorithm.value_norm keeps it O(1))", ge=0.0)
    lr_warmup_steps: int = opt(0, "linear LR warm-up in learner updates", ge=0)
    lr_decay_style: str = opt("constant", "the policy's lr after warm-up: constant, or linear from learner.lr "
                              "at the first update to learner.min_lr at update learner.lr_decay_iters, "
                              "then held (the end of a run moves the policy less)",
                              choices=["constant", "linear"])
    lr_decay_iters: Optional[int] = opt(None, "learner updates the linear decay spans (null: learner.max_steps)",
                                        ge=1)
    min_lr: float = opt(0.0, "the policy's lr where the linear decay ends", ge=0.0)
    critic_warmup_steps: int = opt(0, "first updates in which only the value head trains (the policy's "
                                   "lr is 0): a warm start's critic, fit to demonstrations, first learns "
                                   "the RL returns before its advantages move the policy", ge=0)
    zero_stage: int = opt(3, "DeepSpeed ZeRO stage", choices=[0, 1, 2, 3])
    precision: str = opt("auto", "auto = bf16 on GPU, fp32 on CPU", choices=["auto", "fp32", "bf16"])
    max_policy_lag: int = opt(4, "drop segments produced more than this many versions ago", ge=0)
    max_abs_reward: float = opt(1e4, "drop segments holding a reward with |r| above this (counted as "
                                "bad_reward): a finite but absurd reward would swamp the gradient", gt=0.0)
    max_nonfinite_steps: int = opt(5, "stop the run (non-zero exit) when this many optimizer steps in a row "
                                   "had a non-finite loss or gradient norm; each one is skipped and counted "
                                   "(system/nonfinite_steps)", ge=1)
    max_poisoned_columns: int = opt(4, "an actor whose columns came out non-finite in an update this many times "
                                    "(each dropped before training) is banned: its segments and requests are "
                                    "refused from then on (0: never)", ge=0)
    publish_interval: int = opt(1, "publish weights every this many updates", ge=1)
    rollout_ema_decay: float = opt(0.0, "EMA of published weights: pub <- d*pub + (1-d)*theta "
                                   "(0 = publish the learner's weights as they are)", ge=0.0, lt=1.0)
    dist_timeout_minutes: int = opt(120, "collective time-out; ranks idle while actors are slow", ge=1)
    starvation_timeout_s: float = opt(60.0, "a learner rank that receives no segment for this long logs one "
                                      "line per interval naming the actors it last heard from (0: never)", ge=0.0)
    min_actors: int = opt(0, "before its first update the learner waits until this many actors have joined "
                          "(the evaluator not counted): a fleet's first updates then hold every host's data, and a "
                          "short budget is not spent before the slowest host joins (0: start with the first data)",
                          ge=0)


def check_lr_decay(lc: "LearnerConfig") -> list[str]:
    if lc.min_lr > lc.lr:
        return [f"learner.min_lr={lc.min_lr} is above learner.lr={lc.lr}: the decay only lowers the lr"]
    return []
