"""Checkpoint tag folders made by hand, for tests of what reads and checks them:

    state_tag   a complete tag whose files hold given objects (torch.save, as DeepSpeed writes them)
"""

from __future__ import annotations

import torch

from asyncvla.learner import checkpoint as ck


def state_tag(root, step, states: dict, zero_stage=3):
    """A complete tag whose files hold the given objects (torch.save, as DeepSpeed writes them)."""
    tag = root / ck.tag_name(step)
    tag.mkdir(parents=True)
    for name, obj in states.items():
        torch.save(obj, tag / name)
    ck.mark_complete(tag, list(states), step=step, world_size=1, zero_stage=zero_stage, bf16=False)
    return tag
