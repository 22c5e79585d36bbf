"""The DeepSpeed side of the learner: process group, engine configuration, engine.

    init_distributed(cfg)                                   # once per process, before anything collective
    engine = build_engine(model, EngineSpec.rl(cfg), gradient_accumulation_steps=n_micro)
    for each minibatch:
        for each micro batch:  engine.backward(loss(engine(...)));  engine.step()

Gradient accumulation uses DeepSpeed's managed mode: `engine.step()` is called after every
micro batch and only the n-th call (the accumulation boundary, counted by the engine) reduces
gradients across ranks and updates the weights; `engine.backward` divides the loss by n. So
every minibatch must have exactly n micro batches on every rank. (DeepSpeed 0.19 also has
`engine.set_gradient_accumulation_boundary()` and an unmanaged mode,
`managed_gradient_accumulation: false`, where each `step()` call is the boundary; they would
allow a varying count, at the price of extra calls or an ignored `backward` scaling.)

Only parameters with `requires_grad` are optimised (LoRA + value head with LoRA, everything
otherwise). Parameters whose name contains "value_head" form a second group at their own lr.

An engine is built from an EngineSpec, which holds what the optimiser, its schedule and the engine
need and nothing else: the RL learner's comes from learner.* and algorithm.* (`EngineSpec.rl`),
SFT's from sft.* (learner/sft.py `engine_spec`), so no key of one run leaks into the other's.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from asyncvla.common.config import Config, ConfigError

log = logging.getLogger("asyncvla.learner")

VALUE_HEAD_KEY = "value_head"
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -------------------------------------------------------------------------------- process group
def init_distributed(cfg: Config) -> None:
    """Join (or create) the process group with the collective time-out of the config.

    Under the deepspeed launcher or torch.distributed.run the rendezvous comes from the environment
    they set. A process started without one (a debugging run) becomes a single rank on a free local
    port instead of DeepSpeed's default, which tries MPI discovery.
    """
    import deepspeed

    # DeepSpeed calls these renamed torch collectives on every ZeRO-3 step; each call warns.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)")
    present = [k for k in _DIST_ENV if k in os.environ]
    if not present:
        port = _free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        log.info("no launcher environment: running as a single rank (port %d)", port)
    elif len(present) < len(_DIST_ENV):
        missing = [k for k in _DIST_ENV if k not in os.environ]
        raise ConfigError(f"incomplete distributed environment: {', '.join(missing)} not set "
                          f"(set all of {', '.join(_DIST_ENV)}, or none for a single rank)")
    skip_cpu_shm_op()
    # Idle ranks wait inside collectives while actors are slow: the time-out must outlast that.
    deepspeed.init_distributed(timeout=timedelta(minutes=cfg.learner.dist_timeout_minutes),
                               auto_mpi_discovery=False, verbose=False)


def skip_cpu_shm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op when the process group starts.

    On the CPU accelerator every first process group of a machine JIT-compiles that op (minutes on 2
    cores) under a lock file in the torch extensions directory; a rank killed mid-build leaves the lock
    behind and every later DeepSpeed process waits on it for ever. The op serves only
    `inference_all_reduce`, which training never calls: ZeRO's collectives go through gloo. DeepSpeed
    reads op compatibility from one cached dict, so marking the op incompatible there skips the build.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def close_distributed() -> None:
    """Barrier, then tear the process group down (a rank that exits without it may abort)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- configuration
def use_bf16(precision: str) -> bool:
    """'auto' trains in bf16 on a GPU and in fp32 on a CPU."""
    if precision == "auto":
        return torch.cuda.is_available()
    return precision == "bf16"


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from. lr / value_lr: the policy's and the value head's groups;
    warmup_steps: updates of a linear lr ramp; critic_warmup_steps: first updates in which the policy
    group's lr is 0; steps_per_update: optimizer steps in one update (the schedule counts updates);
    decay_iters: updates of a linear decay of the policy's lr to min_lr_fraction of it (None: none)."""
    lr: float
    value_lr: float
    micro_batch_size: int
    zero_stage: int
    precision: str
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float
    warmup_steps: int = 0
    critic_warmup_steps: int = 0
    steps_per_update: int = 1
    decay_iters: int | None = None
    min_lr_fraction: float = 0.0

    @classmethod
    def rl(cls, cfg: Config) -> "EngineSpec":
        """The RL learner's: learner.*'s optimiser and schedule, an update being
        algorithm.update_epochs x num_minibatches optimizer steps."""
        lc = cfg.learner
        return cls(lr=lc.lr, value_lr=lc.value_lr, micro_batch_size=lc.micro_batch_size, zero_stage=lc.zero_stage,
                   precision=lc.precision, adam_beta1=lc.adam_beta1, adam_beta2=lc.adam_beta2, adam_eps=lc.adam_eps,
                   weight_decay=lc.weight_decay, clip_grad=lc.clip_grad, warmup_steps=lc.lr_warmup_steps,
                   critic_warmup_steps=lc.critic_warmup_steps,
                   steps_per_update=cfg.algorithm.update_epochs * cfg.algorithm.num_minibatches,
                   decay_iters=(lc.lr_decay_iters or lc.max_steps) if lc.lr_decay_style == "linear" else None,
                   min_lr_fraction=lc.min_lr / lc.lr)


def build_ds_config(spec: EngineSpec, world_size: int, gradient_accumulation_steps: int = 1) -> dict:
    """The DeepSpeed config dict of an engine built from `spec`.

    The batch is described per rank (micro batch x accumulation steps); DeepSpeed derives
    train_batch_size = micro x steps x world_size. The LR schedule is not in here: it is a torch
    scheduler given to `deepspeed.initialize` (see `warmup_schedule`).
    """
    if gradient_accumulation_steps < 1:
        raise ConfigError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1")
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    bf16 = use_bf16(spec.precision)
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": spec.micro_batch_size * gradient_accumulation_steps * world_size,
        "optimizer": {"type": "AdamW", "params": {
            "lr": spec.lr, "betas": [spec.adam_beta1, spec.adam_beta2], "eps": spec.adam_eps,
            "weight_decay": spec.weight_decay,
            "torch_adam": True}},          # plain torch AdamW: no JIT-built fused kernel
        "gradient_clipping": spec.clip_grad,
        "zero_optimization": {"stage": spec.zero_stage},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "FAIL"},      # the same tag on every rank, or stop
    }


def warmup_schedule(warmup_steps: int, critic_warmup_steps: int = 0, steps_per_update: int = 1,
                    decay_iters: int | None = None, min_lr_fraction: float = 0.0):
    """Linear warm-up: update k (1-based) runs at lr * min(1, k / warmup_steps); constant after,
    unless decay_iters asks the policy's lr to decay (below).

    Counted in learner updates: an update of `update_epochs` passes over `num_minibatches` takes
    steps_per_update optimizer steps, and the engine steps the schedule once per optimizer step.

    With critic_warmup_steps = W > 0 the policy group (named "policy") holds lr 0 for the first W
    updates and starts its own ramp at update W + 1, while every other group (the value head)
    ramps from update 1: the critic first learns the RL returns, which a warm start's critic (fit
    to demonstrations) does not predict, before its advantages move the policy.

    With decay_iters = D the policy group's lr is also scaled by a linear decay, from 1 at update 1
    to min_lr_fraction at update D + 1, then held there; the value head keeps its lr, so the critic
    goes on tracking the returns while the policy settles.

    DeepSpeed's WarmupLR starts from warmup_min_lr (0 unless set) and repeats it for the first two
    updates; this LambdaLR gives each update its own step of the ramp. Its state (the optimizer
    step count) is saved in checkpoints.
    """
    def ramp(n: int) -> float:
        return 1.0 if warmup_steps <= 1 else min(1.0, (n + 1) / warmup_steps)

    def decay(n: int) -> float:
        if decay_iters is None:
            return 1.0
        return 1.0 - (1.0 - min_lr_fraction) * min(1.0, n / decay_iters)

    def policy_factor(n: int) -> float:
        return 0.0 if n < critic_warmup_steps else ramp(n - critic_warmup_steps) * decay(n)

    def per_update(factor):
        return lambda n: factor(n // steps_per_update)

    def make(optimizer):
        factors = [per_update(policy_factor if g.get("name") == "policy" else ramp)
                   for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
    return make


def lr_schedule(spec: EngineSpec):
    """The schedule (`warmup_schedule`) of an engine built from `spec`."""
    return warmup_schedule(spec.warmup_steps, spec.critic_warmup_steps, spec.steps_per_update,
                           decay_iters=spec.decay_iters, min_lr_fraction=spec.min_lr_fraction)


# ----------------------------------------------------------------------------------------- engine
def param_groups(model: nn.Module, lr: float, value_lr: float) -> list[dict]:
    """Trainable parameters in two groups: the policy at `lr`, the value head at `value_lr`.
    Frozen parameters are left out (the optimiser never sees the base). Empty groups are dropped."""
    policy, value = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (value if VALUE_HEAD_KEY in name else policy).append(p)
    groups = [{"params": policy, "lr": lr, "name": "policy"},
              {"params": value, "lr": value_lr, "name": "value_head"}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters (none with requires_grad); "
                          "check policy.is_lora / the LoRA target modules")
    return groups


def build_engine(model: nn.Module, spec: EngineSpec, gradient_accumulation_steps: int = 1,
                 ds_config: dict | None = None):
    """Wrap `model` in a DeepSpeed engine (the process group must exist: `init_distributed`).

    ds_config: a config from `build_ds_config`, possibly adjusted; by default built from `spec`.
    Under ZeRO-3 the model's parameters are partitioned in place: afterwards read full weights
    only through `publish.gather_trainable`.
    """
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_engine needs the process group: call init_distributed(cfg) first")
    if ds_config is None:
        ds_config = build_ds_config(spec, dist.get_world_size(), gradient_accumulation_steps)
    groups = param_groups(model, spec.lr, spec.value_lr)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config,
                                           lr_scheduler=lr_schedule(spec))
    return engine


def group_lrs(engine) -> dict[str, float]:
    """Current learning rate of each param group, by group name (for logging and tests)."""
    return {g.get("name", str(i)): g["lr"] for i, g in enumerate(engine.optimizer.param_groups)}
