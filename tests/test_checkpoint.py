"""Which checkpoint a resume picks, which ones pruning deletes, what a state file may hold: the
bookkeeping around DeepSpeed's files, on tag folders made by hand (the real DeepSpeed round trip is
in test_engine). Then saves that fail, on real 2-rank DeepSpeed runs (tests/ds_worker.py `faults`,
`faults_resume`): a write that fails on one rank, a really full disk (a small tmpfs, where one can
be mounted), and each rank's random streams across a resume."""

import collections
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncvla.learner import checkpoint as ck
from tests.support.checkpoints import state_tag

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


def test_newest_save_wins_over_step_order(tmp_path):
    """A run resumed from an older tag saves lower step numbers later; the newest save counts."""
    root = tmp_path / "checkpoints"
    make_tag(root, 50)
    t30 = make_tag(root, 30)
    assert ck.find_latest(root) == t30
    (root / "latest_complete").unlink()
    assert ck.find_latest(root) == t30                   # by save time, not by step


def test_resuming_an_older_tag_makes_its_branch_the_run_s(tmp_path):
    """Resumed from step 95 of a run that reached 104: the later tags move to abandoned/ (kept),
    so the run's newest complete checkpoint is the one resumed from until the new branch saves;
    resuming the newest tag moves nothing."""
    root = tmp_path / "run" / "checkpoints"
    t95, t100, t104 = (make_tag(root, s) for s in (95, 100, 104))
    assert ck.find_latest(tmp_path / "run") == t104
    moved = ck.adopt(t95)
    assert [m.name for m in moved] == ["step_00000100", "step_00000104"]
    assert all(m.parent.parent == root / "abandoned" and ck.check_complete(m) is None for m in moved)
    assert not t100.exists() and not t104.exists()
    assert ck.find_latest(tmp_path / "run") == t95
    assert (root / "latest_complete").read_text() == (root / "latest").read_text() == "step_00000095"
    assert ck.adopt(t95) == []
    t100b = make_tag(root, 100)                          # the new branch saves: its tag is the newest
    assert ck.find_latest(root) == t100b and ck.adopt(t100b) == []


def test_a_crash_between_marker_and_pointer_resumes_the_newer_tag(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    make_tag(root, 10)
    t20 = make_tag(root, 20)
    for pointer in ("latest_complete", "latest"):        # marker written, pointers still one behind
        (root / pointer).write_text("step_00000010")
    assert ck.find_latest(tmp_path / "run") == t20
    assert ck.resolve(root) == t20


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


def test_rng_state_loads_with_weights_only():
    buf = __import__("io").BytesIO()
    torch.save(ck.rng_state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)           # no allow-list needed
    first = (random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist())
    ck.set_rng_state(state)
    assert (random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist()) == first


class Payload:
    """Unpickling it calls os.mkdir: what a hostile checkpoint would do with a worse function."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_state_files_holding_arbitrary_objects_are_refused(tmp_path):
    from asyncvla.learner import export

    ran = tmp_path / "payload_ran"
    client = {"step": 7, "config": {"a": [1, 2.5, "x", None]}, "ema": {"shadow": {"w": torch.ones(2)}}}
    good = state_tag(tmp_path / "good", 7, {"mp_rank_00_model_states.pt": {ck.CLIENT_KEY: client,
                                                                          "module": {"w": torch.ones(2).half()}}},
                     zero_stage=0)
    assert ck.read_client_state(good)["config"] == client["config"]
    assert export.consolidate(good)["w"].dtype == torch.float32        # zero_stage 0: one plain file

    bad = state_tag(tmp_path / "bad", 7, {"mp_rank_00_model_states.pt": {ck.CLIENT_KEY: {"x": Payload(ran)}}})
    with pytest.raises(ck.CheckpointError, match=r"pickled objects of posix\.mkdir.*refusing"):
        ck.read_client_state(bad)
    # export consolidates with DeepSpeed's zero_to_fp32, which unpickles unrestricted: checked first
    shard = state_tag(tmp_path / "shard", 7, {"zero_pp_rank_0_mp_rank_00_model_states.pt": {ck.CLIENT_KEY: client},
                                              "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"o": Payload(ran)}})
    assert ck.read_client_state(shard)["step"] == 7
    with pytest.raises(ck.CheckpointError, match=r"optim_states\.pt' holds pickled objects of posix\.mkdir"):
        export.consolidate(shard)
    assert not ran.exists()


def test_older_checkpoints_with_numpy_rng_state_still_load(tmp_path):
    old = {"step": 3, "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}}
    tag = state_tag(tmp_path, 3, {"mp_rank_00_model_states.pt": {ck.CLIENT_KEY: old}})
    state = ck.read_client_state(tag)
    first = np.random.rand(3)
    ck.set_rng_state(state["rng"])
    assert (np.random.rand(3) == first).all()


def test_the_recorded_config_is_read_without_unpickling_any_object(tmp_path):
    """What `asyncvla train` reads before any rank starts: plain values only, never a named object."""
    from asyncvla.common.config import Config

    ran = tmp_path / "payload_ran"
    client = {"config": {"policy": {"n_bins": 64, "action_low": [-1.0]}}, "ema": {"shadow": {"w": torch.ones(2)}},
              "x": Payload(ran)}
    tag = state_tag(tmp_path / "run" / "checkpoints", 3, {"zero_pp_rank_0_mp_rank_00_model_states.pt": {
        ck.CLIENT_KEY: client, "param_shapes": [collections.OrderedDict(w=torch.Size([2]))]}})
    assert ck.recorded_config(tmp_path / "run") == client["config"]
    assert not ran.exists()
    older = state_tag(tmp_path / "older", 3, {"mp_rank_00_model_states.pt": {ck.CLIENT_KEY: {"step": 3}}})
    assert ck.recorded_config(older) is None and ck.check_resume_config(older, Config()) is None
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x" * tag.joinpath(
        "zero_pp_rank_0_mp_rank_00_model_states.pt").stat().st_size)       # complete by size, not a zip
    with pytest.raises(ck.CheckpointError, match="model_states.pt' could not be read: BadZipFile"):
        ck.recorded_config(tag)


def test_only_keys_that_shape_the_policy_must_match_on_resume():
    from asyncvla.common.config import Config, to_dict

    recorded, cfg = to_dict(Config()), Config()
    width, rank = cfg.policy.backbone.text_hidden_size, cfg.policy.lora_rank
    cfg.policy.backbone.text_hidden_size, cfg.policy.lora_rank = width * 2, rank + 1
    cfg.learner.lr, cfg.policy.temperature, cfg.checkpoint.keep_last = 0.5, 0.5, 9       # free to change
    assert ck.structural_changes(recorded, to_dict(cfg)) == [
        f"policy.backbone.text_hidden_size={width} (this config: {width * 2})",
        f"policy.lora_rank={rank} (this config: {rank + 1})"]
    del recorded["policy"]["lora_rank"]                  # a config an older version recorded
    assert len(ck.structural_changes(recorded, to_dict(cfg))) == 1
    assert ck.structural_changes(to_dict(Config()), to_dict(Config())) == []


def test_make_room_deletes_ahead_only_when_the_next_save_would_not_fit(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        make_tag(root, step)
    make_tag(root, 4, complete=False)
    size = sum(100 + i for i in range(len(FILES)))       # make_tag's bytes per tag
    free = {"bytes": 10 * size}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: collections.namedtuple("U", "free")(free["bytes"]))
    names = lambda: sorted(d.name for d in root.iterdir() if d.is_dir())    # noqa: E731
    ck.make_room(root, keep=3)
    assert names() == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    free["bytes"] = size                                 # < 110 % of the newest tag
    ck.make_room(root, keep=3)                           # what pruning after the save would delete
    assert names() == ["step_00000002", "step_00000003"]
    ck.make_room(root, keep=1)                           # the newest complete one always stays
    assert names() == ["step_00000003"]


def test_a_failed_write_reports_the_system_s_reason_not_torch_s_guess(tmp_path):
    """torch.save says "Parent directory ... does not exist" for any folder it cannot use (DeepSpeed
    only logs why it could not make it); the error a save reports is the system's own. Here a
    regular file stands where a folder must go, which fails for root too."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RuntimeError, match="Parent directory") as e:
        torch.save({"w": torch.zeros(1)}, str(blocker / "step_00000001" / "states.pt"))
    text = ck.explain_write_error(e.value)
    assert text.startswith("NotADirectoryError") and str(blocker) in text, text
    assert ck.explain_write_error(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
    assert ck.probe_writable(blocker / "checkpoints").startswith("NotADirectoryError")
    ok = tmp_path / "run" / "checkpoints"
    assert ck.probe_writable(ok) is None and ok.is_dir() and not list(ok.iterdir())     # made, probe gone


# ---------------------------------------------------------------------- real DeepSpeed ranks
def _mount_tiny_disk(path: Path):
    """A 4 MiB tmpfs at `path`, or the reason there is none."""
    path.mkdir()
    if os.geteuid() != 0:
        return None, "mounting a tmpfs needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True, text=True)
    return (path, None) if r.returncode == 0 else (None, f"cannot mount a tmpfs: {r.stderr.strip()}")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    from tests.support.engines import launch

    out = tmp_path_factory.mktemp("faults")
    tiny, why = _mount_tiny_disk(out / "tiny")
    if tiny is not None:
        os.environ["ASYNCVLA_TINY_DISK"] = str(tiny / "run")
    t0 = time.perf_counter()
    try:
        saved = launch("faults", out, 2, timeout=400)
        tiny_latest = ck.find_latest(tiny / "run") if tiny is not None else None
    finally:
        os.environ.pop("ASYNCVLA_TINY_DISK", None)
        if tiny is not None:
            subprocess.run(["umount", str(tiny)], check=False)
    t1 = time.perf_counter()
    resumed = launch("faults_resume", out, 2, timeout=300)
    print(f"\nwall: faults {t1 - t0:.1f} s, faults_resume {time.perf_counter() - t1:.1f} s")
    return {"saved": saved, "resumed": resumed, "tiny_latest": tiny_latest, "no_tiny": why}


def test_a_failed_save_on_one_rank_fails_on_all_leaves_nothing_and_the_next_one_resumes(faults):
    from tests import ds_worker as W

    for stage in W.FAULT_STAGES:
        for rank in (0, 1):
            rec = faults["saved"][rank][stage]
            assert rec["saves"][2] is None and rec["saves"][3] is None, (stage, rank)   # rank 1, rank 0 failed
            assert rec["saves"][1].name == "step_00000001" and rec["saves"][4].name == "step_00000004"
            assert rec["tags"][2] == rec["tags"][3] == ["step_00000001"], (stage, rank)  # no partial tag
            assert rec["tags"][4] == ["step_00000001", "step_00000004"]
            back = faults["resumed"][rank][stage]
            assert Path(back["found"]).name == "step_00000004" and back["state"] == {"step": 4}
        trained, loaded = faults["saved"][0][stage]["trained"], faults["resumed"][0][stage]["loaded"]
        assert trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)


def test_each_rank_resumes_its_own_random_streams(faults):
    from tests import ds_worker as W

    for stage in W.FAULT_STAGES:
        before = [faults["saved"][r][stage]["draws"] for r in (0, 1)]     # drawn right after the save
        after = [faults["resumed"][r][stage]["draws"] for r in (0, 1)]
        assert not torch.equal(before[0]["torch"], before[1]["torch"])     # the ranks' streams differ
        for r in (0, 1):
            assert torch.equal(after[r]["torch"], before[r]["torch"]), (stage, r)
            assert (after[r]["numpy"] == before[r]["numpy"]).all(), (stage, r)
            assert after[r]["python"] == before[r]["python"], (stage, r)


def test_a_full_disk_fails_a_save_and_pruning_ahead_makes_room(faults):
    if faults["no_tiny"]:
        pytest.skip(faults["no_tiny"])
    for rank in (0, 1):
        t = faults["saved"][rank]["tiny"]
        assert [t["saves"][u] is not None for u in (1, 2, 3, 4)] == [True, False, True, True], rank
        assert t["tags"][2] == ["step_00000001"]                          # the partial tag is gone
        assert t["tags"][3] == ["step_00000001", "step_00000003"]
        assert t["tags"][4] == ["step_00000003", "step_00000004"]          # step 1 went before the save
    t0 = faults["saved"][0]["tiny"]
    assert t0["free_after_3"] < t0["tag_size"]           # without making room first, step 4 did not fit
    assert faults["tiny_latest"].name == "step_00000004"
