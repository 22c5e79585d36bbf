"""What a resume refuses, on real DeepSpeed (two ZeRO-3 ranks on the CPU, the model of
tests/ds_worker.py): a checkpoint with one NaN written in place into its EMA weights, one rank's
optimizer state or master weights (the file keeps its size, so it still looks complete) is refused
on load by every rank alike, naming the file and the newest earlier complete checkpoint; a policy
shape other than the checkpoint's is refused naming both values; a clean checkpoint loads, with a
changed learning rate too.

The ranks run in worker processes (this file run as `python -m tests.test_resume_checks PHASE OUT`),
so that no process group lives in the test session: `save` writes updates 1 and 2 as the learner
does, the test poisons copies, and `load` tries each copy in a fresh engine.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncvla.learner import checkpoint as ck
from tests.support.engines import DIST_VARS
from tests.support.paths import REPO
from tests.support.ports import free_ports

WORLD = 2
STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"          # rank 0's: the EMA weights are there
SHARDS = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(WORLD)]
# case: (the copy of the run it loads (None: the run itself), config overrides)
CASES = {"clean": (None, {"learner.lr": 5e-4}),
         "shape": (None, {"policy.backbone.text_hidden_size": 128, "policy.n_bins": 64}),
         "ema": ("ema", {}), "optimizer": ("optimizer", {}), "weights": ("weights", {}),
         "oldest": ("oldest", {})}


def workers(phase: str, out: Path, timeout: float = 300) -> list[dict]:
    """Each rank's record of `phase`; a rank that fails takes the others down (as the launcher would)."""
    port = str(free_ports(1)[0])
    base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    procs = []
    for r in range(WORLD):
        env = dict(base, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(out / f"{phase}_{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_resume_checks", phase, str(out)],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.1)
    logs = "\n".join((out / f"{phase}_{r}.log").read_text()[-3000:] for r in range(WORLD))
    assert all(p.returncode == 0 for p in procs), f"{phase} failed:\n{logs}"
    return [torch.load(out / f"{phase}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


def poison(path: Path, pick) -> None:
    """Overwrite in place, with NaN, the first float of the tensor `pick(state)` chooses in the state
    file at `path` (torch stores tensor bytes uncompressed); the file keeps its size."""
    raw = pick(ck.load_file(path)).detach().contiguous().numpy().tobytes()
    data = path.read_bytes()
    assert data.count(raw) == 1, f"the tensor's bytes are not unique in {path}"
    with open(path, "r+b") as f:
        f.seek(data.index(raw))
        f.write(np.float32("nan").tobytes())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_checks")
    saved = workers("save", out)
    assert sum(r["padding"] for r in saved) > 0, "no partition has padding: the clean case checks nothing of it"
    run = out / "run"
    copies = {"ema": (2, STATES, lambda s: s[ck.CLIENT_KEY]["ema"]["shadow"]["adapter.a"]),
              "optimizer": (2, SHARDS[1], lambda s: s["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
                            ["exp_avg_sq"]),
              "weights": (2, SHARDS[0], lambda s: s["optimizer_state_dict"]["fp32_flat_groups"][1]),
              "oldest": (1, STATES, lambda s: s[ck.CLIENT_KEY]["ema"]["shadow"]["value_head.0.weight"])}
    for name, (step, file, pick) in copies.items():
        shutil.copytree(run, out / name)
        tag = out / name / "checkpoints" / ck.tag_name(step)
        poison(tag / file, pick)
        if name == "oldest":                     # step 1 alone: no earlier one to name
            shutil.rmtree(out / name / "checkpoints" / ck.tag_name(2))
        assert ck.check_complete(tag) is None    # still complete by its marker
    cases = {case: (str(tag_of(out, copy)), overrides) for case, (copy, overrides) in CASES.items()}
    (out / "cases.json").write_text(json.dumps(cases))
    loads = workers("load", out)
    for case in CASES:                           # every rank takes the same verdict
        assert loads[0][case]["error"] == loads[1][case]["error"], case
    return {"out": out, "loads": loads[0]}


def tag_of(out: Path, copy: str | None) -> Path:
    return ck.resolve(out / (copy or "run"))


def test_a_clean_checkpoint_loads_with_another_learning_rate(runs):
    """(Its partitions' padding holds NaN, as unwritten memory may: only values are checked.)"""
    got = runs["loads"]["clean"]
    assert got["error"] is None and got["step"] == 2 and got["loaded"], got
    assert sorted(got["shadow"]) == ["adapter.a", "adapter.b", "value_head.0.bias", "value_head.0.weight",
                                     "value_head.2.bias", "value_head.2.weight"]


@pytest.mark.parametrize("case, what, file", [
    ("ema", "EMA weights 'adapter.a'", STATES),                       # rank 0's part
    ("optimizer", "optimizer state 'exp_avg_sq of master tensor 0'", SHARDS[1]),    # rank 1's alone
    ("weights", "weights 'value_head.", SHARDS[0])])
def test_one_nan_written_into_a_checkpoint_is_refused_naming_the_file_and_the_earlier_one(runs, case, what, file):
    error = runs["loads"][case]["error"]
    tag = tag_of(runs["out"], case)
    assert error is not None and "\n" not in error, error
    assert error.startswith(f"checkpoint '{tag}' holds NaN or inf: {what}"), error
    assert f"in {tag / file};" in error, error
    assert error.endswith(f"checkpoint.resume={tag.parent / ck.tag_name(1)}"), error


def test_a_poisoned_oldest_checkpoint_says_none_is_left(runs):
    error = runs["loads"]["oldest"]["error"]
    assert "EMA weights 'value_head.0.weight'" in error and error.endswith("no earlier complete checkpoint is "
                                                                           "left to resume from"), error


def test_another_policy_shape_is_refused_naming_both_values(runs):
    error = runs["loads"]["shape"]["error"]
    assert error is not None and "\n" not in error, error
    assert "policy.backbone.text_hidden_size=256 (this config: 128)" in error, error
    assert "policy.n_bins=256 (this config: 64)" in error and "learner." not in error, error
    assert not runs["loads"]["shape"]["loaded"]            # refused before DeepSpeed loaded anything


# ------------------------------------------------------------------------------------- the worker
def phase_save(out: Path) -> dict:
    from asyncvla.common.config import to_dict
    from asyncvla.learner.publish import EmaWeights, gather_trainable
    from tests import ds_worker as W

    cfg = W.make_config()
    rank = torch.distributed.get_rank()
    engine, _ = W.build(cfg, WORLD)
    ema = EmaWeights(cfg.learner.rollout_ema_decay) if rank == 0 else None
    padding = 0
    for update in (1, 2):
        W.engine_update(engine, update, rank)
        padding = nan_padding(engine)
        gathered = gather_trainable(engine)              # (a collective: every rank)
        if ema is not None:
            ema.update(gathered)
        state = {"step": update, "version": update, "env_steps": 100 * update, "config": to_dict(cfg),
                 "ema": ema.state_dict() if ema is not None else None}
        assert ck.save(engine, out / "run", update, state, keep_last=3) is not None
    return {"padding": padding}


def nan_padding(engine) -> int:
    """Write NaN into the padding at the end of each ZeRO-3 partition of the master weights (which
    DeepSpeed allocates and never writes, so it holds whatever the allocator had); return how many
    elements that was. A checkpoint's finite check must not read them."""
    from asyncvla.learner.publish import partition_elements

    count, opt = 0, engine.optimizer
    for flat, group in zip(opt.fp32_partitioned_groups_flat, opt.fp16_groups):
        offset = 0
        for p in group:
            held = partition_elements(p).numel()
            with torch.no_grad():
                flat.narrow(0, offset + held, p.partition_numel() - held).fill_(float("nan"))
            count += p.partition_numel() - held
            offset += p.partition_numel()
    return count


def phase_load(out: Path) -> dict:
    from asyncvla.learner.publish import gather_trainable
    from tests import ds_worker as W

    rec = {}
    for case, (tag, overrides) in json.loads((out / "cases.json").read_text()).items():
        cfg = W.make_config()
        for key, value in overrides.items():
            *sections, name = key.split(".")
            setattr(__import__("functools").reduce(getattr, sections, cfg), name, value)
        engine, _ = W.build(W.make_config(), WORLD)
        before = gather_trainable(engine, all_ranks=True)
        try:
            state = ck.load(engine, tag, config=cfg)
            rec[case] = {"error": None, "step": state["step"], "shadow": (state["ema"] or {}).get("shadow", {})}
        except ck.CheckpointError as e:
            rec[case] = {"error": str(e)}
        after = gather_trainable(engine, all_ranks=True)
        rec[case]["loaded"] = any(not torch.equal(before[k], after[k]) for k in before)
    return rec


if __name__ == "__main__":
    from asyncvla.learner import engine as ds_engine
    from tests import ds_worker as W

    phase, out = sys.argv[1], Path(sys.argv[2])
    ds_engine.init_distributed(W.make_config())
    record = {"save": phase_save, "load": phase_load}[phase](out)
    torch.save(record, out / f"{phase}_rank{torch.distributed.get_rank()}.pt")
    ds_engine.close_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                 # as tests/ds_worker.py: no library thread can fail a finished phase
