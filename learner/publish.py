"""Weights the actors receive: gather the trainable tensors out of ZeRO-3, EMA them, hand them over.

    tensors = gather_trainable(engine)           # EVERY rank (a collective); full fp32 on rank 0
    if rank == 0:
        published = ema.update(tensors)          # θ_pub <- d·θ_pub + (1-d)·θ, fp32 shadow
        weights.publish(version, published)

The learner's loop does that with `Publisher(decay, rank0).publish(engine, version, step)`, which
holds the EMA (`EmaWeights`) on rank 0, serves the result on the weight server it was started on,
and returns the timings of each part.

Names are the module's own parameter names (as an un-wrapped copy of the model sees them), so
an actor can `load_trainable_state_dict` them straight into its copy.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch
from torch import nn

from asyncvla.learner.collectives import any_rank

# Gather at most this many elements at once: a full fine-tune of a large model must not be
# materialised whole on every rank. LoRA + value head fit in one bucket.
GATHER_BUCKET_NUMEL = 1 << 27


def gather_trainable(model, *, all_ranks: bool = False,
                     bucket_numel: int = GATHER_BUCKET_NUMEL) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU copies of the trainable parameters (requires_grad), never the frozen base.

    A collective under ZeRO-3: every rank must call it, with the same model, or the job hangs.
    Returns the tensors on rank 0 and None on the other ranks (all ranks get them with
    all_ranks=True). Works on a DeepSpeed engine (any ZeRO stage) and on a plain module.
    """
    import deepspeed
    import torch.distributed as dist

    module = unwrap(model)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    keep = all_ranks or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for bucket in _buckets(named, bucket_numel):
        # Same buckets in the same order on every rank: bucket bounds come from ds_numel, which
        # every rank knows (a partitioned parameter's own numel() is 0).
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            if keep:
                for name, p in bucket:
                    full = p.detach()
                    if tuple(full.shape) != _full_shape(p):
                        raise RuntimeError(f"parameter '{name}' was not gathered: shape "
                                           f"{tuple(full.shape)}, expected {_full_shape(p)}")
                    out[name] = full.to(device="cpu", dtype=torch.float32, copy=True)
    return out if keep else None


def trainable_finite(model) -> bool:
    """True when this rank's part of every trainable parameter is free of NaN and inf. No collective."""
    return nonfinite(local_trainable(model)) is None


def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor of `named` ((name, tensor) pairs) that holds NaN or inf, else
    None. The one finite check of weights: before a publish or a save, and when a checkpoint loads."""
    for name, t in named:
        if not torch.isfinite(t).all():
            return name
    return None


def local_trainable(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) of every trainable parameter: under ZeRO-3 its partition
    (`ds_tensor`) without padding, otherwise the whole tensor."""
    for name, p in unwrap(model).named_parameters():
        if p.requires_grad:
            yield name, p.data if getattr(p, "ds_tensor", None) is None else partition_elements(p)


def partition_elements(p) -> torch.Tensor:
    """The elements of a ZeRO-3 parameter's local partition that hold its values. Partitions are
    equal in size, so the last ranks' end in padding that DeepSpeed allocates but never writes:
    read as weights it is whatever the allocator held before (NaN now and then)."""
    size = p.ds_tensor.numel()
    rank = getattr(p, "ds_zero_partition_rank", None)
    if rank is None:
        rank = torch.distributed.get_rank(group=p.ds_process_group)
    return p.ds_tensor.narrow(0, 0, max(0, min(size, p.ds_numel - rank * size)))


def unwrap(model) -> nn.Module:
    """The user's module inside a DeepSpeed engine (whose own names carry a 'module.' prefix)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _full_shape(p: torch.Tensor) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape))


def _full_numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _buckets(named: list, bucket_numel: int) -> Iterator[list]:
    bucket, size = [], 0
    for item in named:
        n = _full_numel(item[1])
        if bucket and size + n > bucket_numel:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


class EmaWeights:
    """The published weights θ_pub <- d·θ_pub + (1-d)·θ, kept in fp32 (bf16 would swallow the small
    updates of a decay near 1). The first update sets θ_pub = θ; d = 0 publishes θ as it is.

    Lives on rank 0 only, with the publisher. `update` returns fresh tensors in `dtype` (copies:
    the transport may still be sending them while the shadow moves on). `timings` holds the last
    update's seconds.
    """

    def __init__(self, decay: float, dtype: torch.dtype = torch.float32):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"rollout_ema_decay={decay} must be in [0, 1)")
        self.decay = float(decay)
        self.dtype = dtype
        self.shadow: dict[str, torch.Tensor] | None = None
        self.updates = 0
        self.timings: dict[str, float] = {}

    def update(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        if self.shadow is None or self.decay == 0.0:
            self.shadow = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in tensors.items()}
        else:
            self._check_names(tensors)
            d = self.decay
            for k, s in self.shadow.items():
                s.mul_(d).add_(tensors[k].detach().to("cpu", torch.float32), alpha=1.0 - d)
        self.updates += 1
        out = self.published()
        self.timings = {"ema_s": time.perf_counter() - t0}
        return out

    def published(self) -> dict[str, torch.Tensor]:
        """Copies of the current θ_pub in the publishing dtype (empty before the first update)."""
        return {k: v.to(self.dtype, copy=True) for k, v in (self.shadow or {}).items()}

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "shadow": None if self.shadow is None else {k: v.clone() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore θ_pub from a checkpoint. The decay stays the one this publisher was built with
        (a resumed run may change rollout_ema_decay)."""
        if not isinstance(state, dict) or "shadow" not in state:
            raise ValueError("EMA state must be a dict from EmaWeights.state_dict() (with 'shadow')")
        shadow = state["shadow"]
        self.shadow = None if shadow is None else {k: torch.as_tensor(v).to("cpu", torch.float32, copy=True)
                                                    for k, v in shadow.items()}
        self.updates = int(state.get("updates", 0))

    def _check_names(self, tensors: dict) -> None:
        if tensors.keys() != self.shadow.keys():
            missing = sorted(self.shadow.keys() - tensors.keys())
            extra = sorted(tensors.keys() - self.shadow.keys())
            raise KeyError(f"EMA update with different tensors: missing {missing[:3]}, "
                           f"unexpected {extra[:3]} (the trainable set must not change during a run)")


class Publisher:
    """The learner's publishing. Every publish_interval: gather the trainable weights (a collective:
    every rank calls `publish`), then on rank 0, which holds the EMA of the published weights and
    serves them on the weight server (`start`), average and serve them as the new version. Its
    timings, the same keys on every rank: gather_s, ema_s, serve_s."""

    def __init__(self, decay: float, rank0: bool):
        self.ema = EmaWeights(decay) if rank0 else None
        self.server = None

    def start(self, model, version: int, step: int, server, resumed: bool, device) -> dict:
        """Serve on `server` (rank 0's weight server; None elsewhere) from now on, and publish the
        first version: the initial weights, or a resumed run's EMA weights exactly as its
        checkpoint holds them. Initial weights that are not finite stop the run (every rank)."""
        self.server = server
        if any_rank(not trainable_finite(model), device):
            raise SystemExit("asyncvla learner: the initial trainable weights are non-finite (policy.pretrained_path "
                             "or the checkpoint resumed from holds NaN or inf)")
        return self.republish(version, step) if resumed else self.publish(model, version, step)

    def publish(self, model, version: int, step: int) -> dict:
        """Publish `version`, made by update `step`; its timings on this rank."""
        t0 = time.perf_counter()
        tensors = gather_trainable(model)
        times = {"gather_s": time.perf_counter() - t0, "ema_s": 0.0, "serve_s": 0.0}
        if self.ema is not None and tensors is not None:
            published = self.ema.update(tensors)
            times["ema_s"] = self.ema.timings["ema_s"]
            t1 = time.perf_counter()
            if self.server is not None:
                self.server.publish(version, {k: v.numpy() for k, v in published.items()}, step)
            times["serve_s"] = time.perf_counter() - t1
        return times

    def republish(self, version: int, step: int) -> dict:
        """Serve the EMA weights exactly as a checkpoint restored them (a resumed run; no gather).
        Non-finite ones raise ValueError instead (checkpoint.load refuses them first): an actor
        would refuse them and wait, and the learner with it, for weights that never come."""
        if self.ema is not None and self.server is not None:
            published = self.ema.published()
            bad = nonfinite(published.items())
            if bad is not None:
                raise ValueError(f"the restored EMA weights hold NaN or inf (tensor '{bad}'); version {version} "
                                 "not served")
            self.server.publish(version, {k: v.numpy() for k, v in published.items()}, step)
        return {"gather_s": 0.0, "ema_s": 0.0, "serve_s": 0.0}

    def ema_state(self) -> dict | None:
        """What a checkpoint keeps of the published weights (rank 0's; None elsewhere)."""
        return self.ema.state_dict() if self.ema is not None else None

    def restore(self, state: dict | None) -> None:
        """The published weights of the checkpoint a run resumes from."""
        if self.ema is not None:
            self.ema.load_state_dict(state)
