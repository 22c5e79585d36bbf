"""Every rank's random generators, saved with a checkpoint and restored on resume: a resumed run
draws what the uninterrupted one would have."""

from __future__ import annotations

import random

import numpy as np


def rng_state() -> dict:
    """This process's random generators (python, numpy, torch, and CUDA when present), as tensors
    and plain values (so that torch.load(weights_only=True) reads them)."""
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]               # keys: a tensor, or older checkpoints' array
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_states(engine, rank: int, world: int) -> dict:
    """{rank: rng_state()} for the state file(s) DeepSpeed writes: under ZeRO-3 each rank writes
    its own and keeps its own generators there; otherwise rank 0's file alone carries every rank's."""
    own = rng_state()
    if engine.zero_optimization_partition_weights():
        return {rank: own}
    from asyncvla.learner.collectives import gather
    return dict(enumerate(gather(own)))
