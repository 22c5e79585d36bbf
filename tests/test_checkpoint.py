"""Which checkpoint a resume picks, and which ones pruning deletes: the bookkeeping around
DeepSpeed's files, on tag folders made by hand (the real DeepSpeed round trip is in test_engine)."""

import random

import numpy as np
import pytest
import torch

from asyncvla.learner import checkpoint as ck

FILES = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def make_tag(root, step, complete=True):
    tag = root / ck.tag_name(step)
    tag.mkdir(parents=True)
    for i, name in enumerate(FILES):
        (tag / name).write_bytes(b"x" * (100 + i))
    if complete:
        ck.mark_complete(tag, FILES, step=step, world_size=2, zero_stage=3, bf16=False)
    return tag


def test_newest_complete_tag_is_found_from_run_checkpoints_or_tag_dir(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    make_tag(root, 10)
    t20 = make_tag(root, 20)
    make_tag(root, 30, complete=False)                  # a save that was interrupted
    assert ck.find_latest(tmp_path / "run") == t20
    assert ck.find_latest(root) == t20
    assert ck.find_latest(t20) == t20
    assert ck.find_latest(root / ck.tag_name(30)) is None
    assert (root / "latest_complete").read_text() == "step_00000020"


def test_a_damaged_newest_tag_is_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    t10 = make_tag(root, 10)
    t20 = make_tag(root, 20)
    (t20 / FILES[3]).unlink()                            # pointer names it, but a shard is gone
    assert ck.find_latest(root) == t10
    (t20 / FILES[3]).write_bytes(b"short")               # back, but not what was written
    assert "has 5 bytes" in ck.check_complete(t20)
    assert ck.find_latest(root) == t10


def test_pointer_wins_over_step_order(tmp_path):
    """A run resumed from an older tag saves lower step numbers later; the newest save counts."""
    root = tmp_path / "checkpoints"
    make_tag(root, 50)
    t30 = make_tag(root, 30)
    assert ck.find_latest(root) == t30
    (root / "latest_complete").unlink()
    assert ck.find_latest(root) == t30                   # by save time, not by step


def test_resolve_explains_why_nothing_can_be_resumed(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.resolve(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ck.CheckpointError, match="no checkpoints under"):
        ck.resolve(tmp_path / "empty")
    make_tag(tmp_path / "run" / "checkpoints", 5, complete=False)
    with pytest.raises(ck.CheckpointError, match="no completion marker"):
        ck.resolve(tmp_path / "run")
    assert ck.find_latest(tmp_path / "run") is None
    (tmp_path / "run" / "checkpoints" / "step_00000005" / ck.MARKER).write_text("{not json")
    assert "unreadable" in ck.check_complete(tmp_path / "run" / "checkpoints" / "step_00000005")


def test_prune_keeps_the_last_k_complete_and_drops_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        make_tag(root, step)
    make_tag(root, 4, complete=False)                    # leftover of a crashed save
    make_tag(root, 5)
    ck.prune(root, keep=2, current="step_00000005")
    assert sorted(d.name for d in root.iterdir() if d.is_dir()) == ["step_00000003", "step_00000005"]
    ck.prune(root, keep=1, current="step_00000005")
    assert sorted(d.name for d in root.iterdir() if d.is_dir()) == ["step_00000005"]
    ck.prune(root, keep=1, current="step_00000005")      # never the only complete one
    assert ck.find_latest(root).name == "step_00000005"


def test_rng_state_round_trip():
    state = ck.rng_state()
    first = (random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist())
    random.random(), np.random.rand(5), torch.rand(5)
    ck.set_rng_state(state)
    assert (random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist()) == first
