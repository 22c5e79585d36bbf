"""Checkpoints that are only ever resumed when complete.

    <run>/checkpoints/
        step_00000050/          DeepSpeed's files of one save (every rank's shards) + COMPLETE.json
        latest_complete         name of the newest complete tag (ours, replaced atomically)
        latest                  the same, for DeepSpeed's own tools (zero_to_fp32.py)
        zero_to_fp32.py         DeepSpeed's script: full fp32 weights out of a ZeRO checkpoint

DeepSpeed writes its `latest` before the ranks have finished writing (issues #1793, #5405), so a
crash can leave it naming a half-written tag. Here every rank writes, all meet at a barrier, rank
0 checks that each rank's files are on disk and only then writes the tag's completion marker
(listing every file and its size) and moves the pointers. Resuming accepts only a tag whose
marker exists and whose files are all present with the recorded sizes. The checkpoints folder
must be on a filesystem every rank sees (as DeepSpeed's own loading assumes).

client_state (step, version, env steps, EMA, RNG, config) is stored under one key of DeepSpeed's
state file, so `load` hands it back without DeepSpeed's own keys.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from asyncvla.common.config import ConfigError

log = logging.getLogger("asyncvla.learner")

from asyncvla.common.rundir import CHECKPOINTS  # noqa: E402  (the run layout's one name for it)
MARKER = "COMPLETE.json"
POINTER = "latest_complete"
CLIENT_KEY = "asyncvla_client_state"
TAG_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed, phrased for the user: which one, why, what to do."""


def tag_name(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------------------ save
def save(engine, run_dir, step: int, client_state: dict, keep_last: int = 3) -> Path:
    """Save a checkpoint of every rank (a collective: all ranks call it) and mark it complete.

    Returns the tag directory. After it returns the tag is complete on every rank; then all but
    the newest `keep_last` complete tags (and any incomplete leftovers) are deleted.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(run_dir) / CHECKPOINTS
    tag = tag_name(step)
    tag_dir = root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():        # left by an earlier branch of this run: never mix two saves
            _remove_tag(tag_dir)
    dist.barrier()

    t0 = time.perf_counter()
    ok = engine.save_checkpoint(str(root), tag=tag, client_state={CLIENT_KEY: client_state},
                                save_latest=False)
    engine._asyncvla_saved = True       # see load(): ZeRO-3 cannot load into an engine that saved
    written = _own_files(engine, root, tag) if ok is not False else None
    for name in written or ():
        _fsync(tag_dir / name)           # on disk before the marker can claim they are
    dist.barrier()                       # every rank's files are written (or it failed)
    reports = [None] * world
    dist.all_gather_object(reports, written)

    problem = None
    if rank == 0:
        problem = _check_written(tag_dir, reports)
        if problem is None:
            mark_complete(tag_dir, [name for r in reports for name in r], step=step, world_size=world,
                          zero_stage=engine.zero_optimization_stage(), bf16=engine.bfloat16_enabled())
            prune(root, keep=keep_last, current=tag)
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(f"checkpoint {tag_dir} was not written completely: {verdict[0]}")
    log.info("checkpoint %s complete (%.2f s)", tag_dir, time.perf_counter() - t0)
    return tag_dir


def _own_files(engine, root: Path, tag: str) -> list[str]:
    """Names (relative to the tag dir) of the files this rank's save_checkpoint wrote. DeepSpeed
    decides per rank whether it writes a model-states file and a ZeRO optimizer shard."""
    names = []
    if engine.save_non_zero_checkpoint:
        names.append(Path(engine._get_ckpt_name(str(root), tag)).name)
    if engine.save_zero_checkpoint:
        names.append(Path(engine._get_zero_ckpt_name(str(root), tag)).name)
    return names


def _check_written(tag_dir: Path, reports: list) -> str | None:
    for r, names in enumerate(reports):
        if names is None:
            return f"rank {r} reported a failed save_checkpoint"
        for name in names:
            p = tag_dir / name
            if not p.is_file() or p.stat().st_size == 0:
                return f"rank {r}'s file {name} is missing or empty"
    return None


def mark_complete(tag_dir: Path, files: list[str], *, step: int, world_size: int, zero_stage: int,
                  bf16: bool) -> None:
    """Write the tag's marker (every file with its size), then point `latest_complete` and
    DeepSpeed's `latest` at it; each write is atomic (temporary file + rename)."""
    tag_dir = Path(tag_dir)
    sizes = {name: (tag_dir / name).stat().st_size for name in files}
    _write_atomic(tag_dir / MARKER, json.dumps({
        "tag": tag_dir.name, "step": step, "world_size": world_size, "zero_stage": zero_stage,
        "bf16": bool(bf16), "saved_at": time.time(), "files": sizes}, indent=1))
    _write_atomic(tag_dir.parent / POINTER, tag_dir.name)
    _write_atomic(tag_dir.parent / "latest", tag_dir.name)


def prune(root: Path, keep: int, current: str) -> None:
    """Keep the newest `keep` complete tags (the one just written among them); delete older
    complete tags and incomplete leftovers of interrupted saves."""
    complete = _complete_tags(Path(root))
    doomed = [t for t in complete[:-max(keep, 1)] if t.name != current]
    doomed += [d for d in _tag_dirs(Path(root)) if d.name != current and d not in complete]
    for d in doomed:
        _remove_tag(d)
        log.info("deleted checkpoint %s", d)


def _remove_tag(tag_dir: Path) -> None:
    # The marker goes first: a half-deleted tag must never look complete.
    (tag_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=True)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return                            # missing: _check_written reports it
    try:
        os.fsync(fd)
    except OSError:
        pass                              # some filesystems cannot sync a directory
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)                   # make the rename itself durable


# ------------------------------------------------------------------------------------------ find
def check_complete(tag_dir) -> str | None:
    """None if `tag_dir` is a complete checkpoint, else the reason it is not."""
    tag_dir = Path(tag_dir)
    marker = tag_dir / MARKER
    if not marker.is_file():
        return f"no completion marker {MARKER} (the save was interrupted, or not written by this program)"
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable completion marker {MARKER} ({e})"
    for name, size in files.items():
        p = tag_dir / name
        if not p.is_file():
            return f"file {name} is missing (the checkpoint is damaged)"
        if p.stat().st_size != size:
            return (f"file {name} has {p.stat().st_size} bytes, {size} were written "
                    "(the checkpoint is damaged)")
    return None


def read_marker(tag_dir) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def resolve(path) -> Path:
    """The checkpoint to resume from `path` (a run dir, its checkpoints dir, or one tag dir), or a
    CheckpointError that says why there is none."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{path}' does not exist")
    if _looks_like_tag(p):
        reason = check_complete(p)
        if reason:
            raise CheckpointError(f"checkpoint '{p}' cannot be resumed: {reason}"
                                  + _alternatives(p.parent))
        return p
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    pointer = root / POINTER
    if pointer.is_file():
        tag = root / pointer.read_text().strip()
        if tag.is_dir() and check_complete(tag) is None:
            return tag
    complete = _complete_tags(root)
    if complete:
        return complete[-1]
    found = _tag_dirs(root)
    if not found:
        raise CheckpointError(f"no checkpoints under '{path}' (expected a run directory, its "
                              f"'{CHECKPOINTS}' folder or a checkpoint folder such as {tag_name(0)})")
    reasons = "; ".join(f"{d.name}: {check_complete(d)}" for d in found[-3:])
    raise CheckpointError(f"no complete checkpoint under '{path}' ({reasons})")


def find_latest(path) -> Path | None:
    """The newest complete checkpoint under `path` (see `resolve`), or None. Incomplete or
    damaged tags are never returned."""
    try:
        return resolve(path)
    except CheckpointError:
        return None


def _looks_like_tag(p: Path) -> bool:
    return p.is_dir() and ((p / MARKER).exists() or TAG_RE.match(p.name) is not None
                           or any(p.glob("*model_states.pt")))


def _tag_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and TAG_RE.match(d.name)),
                  key=lambda d: int(TAG_RE.match(d.name).group(1)))


def _complete_tags(root: Path) -> list[Path]:
    """Complete tags, oldest first by save time (a resumed run may save a lower step later)."""
    done = [d for d in _tag_dirs(root) if check_complete(d) is None]
    return sorted(done, key=lambda d: (read_marker(d).get("saved_at", 0.0), d.name))


def _alternatives(root: Path) -> str:
    complete = _complete_tags(root)
    return f"; complete ones: {', '.join(d.name for d in complete[-3:])}" if complete else ""


# ------------------------------------------------------------------------------------------ load
def load(engine, ckpt_dir, load_optimizer: bool = True) -> dict:
    """Restore weights, optimizer, LR schedule into a freshly built engine (a collective: all ranks)
    and return the client_state given to `save`. Raises CheckpointError naming the problem
    (missing, incomplete or damaged checkpoint, other world size or ZeRO stage)."""
    import torch.distributed as dist

    problem, tag_dir = None, None
    try:
        tag_dir = resolve(ckpt_dir)
        problem = _check_compatible(engine, tag_dir, dist.get_world_size())
    except CheckpointError as e:
        problem = str(e)
    # Every rank must take the same branch, or the ones that go on hang in load_checkpoint.
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)

    try:
        path, state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                             load_optimizer_states=load_optimizer,
                                             load_lr_scheduler_states=load_optimizer)
    except Exception as e:
        raise CheckpointError(f"checkpoint '{tag_dir}' could not be loaded: {type(e).__name__}: {e}") from e
    if path is None or state is None:
        raise CheckpointError(f"DeepSpeed found nothing to load in '{tag_dir}'")
    if CLIENT_KEY not in state:
        raise CheckpointError(f"checkpoint '{tag_dir}' holds no training state of this program "
                              f"(key '{CLIENT_KEY}' missing)")
    log.info("loaded checkpoint %s", tag_dir)
    return state[CLIENT_KEY]


def read_client_state(ckpt_dir) -> dict:
    """The client_state of a complete checkpoint, read from rank 0's file without an engine
    (tensors on the CPU). Raises CheckpointError like `load`."""
    tag_dir = resolve(ckpt_dir)
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"checkpoint '{tag_dir}' has no rank-0 model states file")
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{files[0]}' could not be read: {type(e).__name__}: {e}") from e
    if CLIENT_KEY not in state:
        raise CheckpointError(f"checkpoint '{tag_dir}' holds no training state of this program "
                              f"(key '{CLIENT_KEY}' missing)")
    return state[CLIENT_KEY]


def _check_compatible(engine, tag_dir: Path, world: int) -> str | None:
    meta = read_marker(tag_dir)
    if getattr(engine, "_asyncvla_saved", False) and engine.zero_optimization_stage() == 3:
        return ("cannot load a checkpoint into an engine that has saved one under ZeRO-3 (its "
                "weights are partitioned); build a fresh engine and load into that")
    sharded = any("zero_pp_rank_" in name for name in meta.get("files", {}))
    if sharded and meta.get("world_size") != world:
        return (f"checkpoint '{tag_dir}' was written by {meta.get('world_size')} learner ranks but this "
                f"run has {world}. A ZeRO checkpoint loads only at the world size that wrote it: resume "
                f"with launch.num_learner_ranks={meta.get('world_size')}, or export full weights with "
                f"'python {tag_dir.parent / 'zero_to_fp32.py'} {tag_dir.parent} OUT -t {tag_dir.name}' "
                f"and start a new run from them")
    stage = engine.zero_optimization_stage()
    if meta.get("zero_stage") != stage:
        return (f"checkpoint '{tag_dir}' was written with ZeRO stage {meta.get('zero_stage')} but this "
                f"run uses learner.zero_stage={stage}; resume with "
                f"learner.zero_stage={meta.get('zero_stage')}")
    return None


# ------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This process's random generators (python, numpy, torch, and CUDA when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
