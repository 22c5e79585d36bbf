"""Loading a checkpoint into a fresh engine, only as it was trained: `load` refuses one whose
weights, optimizer state or EMA weights hold NaN or inf (naming the file, and the newest earlier
complete checkpoint), and one whose recorded config sets a FIXED_ON_RESUME key otherwise than the
resumed run's. client_state (step, version, env steps, EMA, config) comes back without DeepSpeed's
own keys, and each rank's random generators are restored."""

from __future__ import annotations

import logging
from pathlib import Path

from .compat import check_compatible, check_resume_config
from .layout import CLIENT_KEY, RNG_KEY, CheckpointError
from .resume import earlier_complete, resolve
from .rng import set_rng_state

log = logging.getLogger("asyncvla.learner")


def load(engine, ckpt_dir, load_optimizer: bool = True, config=None) -> dict:
    """Restore weights, optimizer, LR schedule into a freshly built engine (a collective: all ranks)
    and each rank's random generators as they were at the save; return the client_state given to
    `save`. Raises CheckpointError on every rank, naming the problem: a missing, incomplete or
    damaged checkpoint, another world size or ZeRO stage, a FIXED_ON_RESUME key that `config` (the
    resuming run's Config; None: not compared) sets otherwise, or NaN or inf in what was loaded."""
    import torch.distributed as dist

    problem, tag_dir = None, None
    try:
        tag_dir = resolve(ckpt_dir)
        problem = check_compatible(engine, tag_dir, dist.get_world_size()) or \
            (check_resume_config(tag_dir, config) if config is not None else None)
    except CheckpointError as e:
        problem = str(e)
    _agree(problem)          # every rank takes the same branch, or the others hang in load_checkpoint

    try:
        path, state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                             load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=load_optimizer)
    except Exception as e:
        path, state = None, None
        problem = f"checkpoint '{tag_dir}' could not be loaded: {type(e).__name__}: {e}"
    else:
        problem = _check_loaded(engine, tag_dir, path, state, load_optimizer)
    # (each rank holds its own part of the weights and optimizer state)
    _agree(problem, refused=tag_dir)
    client = state[CLIENT_KEY]
    # Checkpoints written before RNG_KEY existed hold the learner's generators (rank 0's) in "rng".
    own = (state.get(RNG_KEY) or {}).get(dist.get_rank(), client.get("rng"))
    if own is not None:
        set_rng_state(own)
    log.info("loaded checkpoint %s", tag_dir)
    return client


def _agree(problem: str | None, refused: Path | None = None) -> None:
    """Raise CheckpointError on every rank when any rank has a problem (the first one's), so that
    all take the same branch (a collective: all ranks call it); with `refused`, the problem makes
    that checkpoint unusable, and the error names the one to resume from instead."""
    from asyncvla.learner.collectives import first_problem
    problem = first_problem(problem)
    if problem:
        raise CheckpointError(problem, refused, earlier_complete(refused) if refused is not None else None)


def _check_loaded(engine, tag_dir: Path, path, state, optimizer: bool) -> str | None:
    if path is None or state is None:
        return f"DeepSpeed found nothing to load in '{tag_dir}'"
    if CLIENT_KEY not in state:
        return f"checkpoint '{tag_dir}' holds no training state of this program (key '{CLIENT_KEY}' missing)"
    return _nonfinite(engine, state[CLIENT_KEY], tag_dir, optimizer)


def _nonfinite(engine, client: dict, tag_dir: Path, optimizer: bool) -> str | None:
    """None when what this rank loaded is free of NaN and inf (the check before every publish and
    save): its part of the weights, of the optimizer state (with `optimizer`), and the EMA weights
    its client_state holds. Else one line naming the tensor, the file it came from and the
    checkpoint to resume instead."""
    from asyncvla.learner.publish import local_trainable, nonfinite

    states, shard = _state_files(engine, tag_dir)
    ema = (client.get("ema") or {}).get("shadow") or {}
    for what, named, name in (("weights", local_trainable(engine), shard),
                              ("optimizer state", _optimizer_tensors(engine) if optimizer else (), shard),
                              ("EMA weights", ema.items(), states)):
        bad = nonfinite(named)
        if bad is not None:
            earlier = earlier_complete(tag_dir)
            instead = (f"resume from the newest earlier complete checkpoint instead: checkpoint.resume={earlier}"
                       if earlier else "no earlier complete checkpoint is left to resume from")
            return f"checkpoint '{tag_dir}' holds NaN or inf: {what} '{bad}' in {tag_dir / name}; {instead}"
    return None


def _state_files(engine, tag_dir: Path) -> tuple[str, str]:
    """(this rank's model-states file, the file its weights and optimizer state load from: its ZeRO
    shard where DeepSpeed writes one, else the same file)."""
    root, tag = str(tag_dir.parent), tag_dir.name
    states = Path(engine._get_ckpt_name(root, tag)).name
    sharded = engine.zero_optimization() or engine.bfloat16_enabled()       # as DeepSpeed's load decides
    return states, Path(engine._get_zero_ckpt_name(root, tag)).name if sharded else states


def _optimizer_tensors(engine):
    """(name, tensor) of this rank's optimizer state: each master tensor the optimizer inside
    DeepSpeed's wrapper steps (under ZeRO this rank's flat partition of a param group; ZeRO-3 hands
    them to its param groups only during a step) and its state (Adam's moments), without the
    padding ZeRO-3 never writes (see `_written`)."""
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for k, (master, state) in enumerate(inner.state.items()):
        written = _written(engine.optimizer, master)
        yield f"master tensor {k}", written(master)
        for key, value in state.items():
            if torch.is_tensor(value):
                yield f"{key} of master tensor {k}", written(value) if value.shape == master.shape else value


def _written(optimizer, master):
    """A function that keeps, of a tensor shaped as `master`, the elements that hold values. A ZeRO-3
    master tensor concatenates its params' local partitions, whose ends on the last ranks are padding
    DeepSpeed allocates but never writes (NaN now and then, as `publish.partition_elements` says)."""
    import torch

    from asyncvla.learner.publish import partition_elements

    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
    group = next((optimizer.fp16_groups[i] for i, flat in enumerate(flats) if flat is master), None)
    if group is None or sum(p.partition_numel() for p in group) != master.numel():
        return lambda t: t                                   # not ZeRO-3's layout: all of it holds values
    spans, offset = [], 0
    for p in group:
        spans.append((offset, partition_elements(p).numel()))
        offset += p.partition_numel()
    return lambda t: torch.cat([t.narrow(0, start, n) for start, n in spans])
