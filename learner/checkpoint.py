"""Checkpoints that are only ever resumed when complete.

    <run>/checkpoints/
        step_00000050/          DeepSpeed's files of one save (every rank's shards) + COMPLETE.json
        latest_complete         name of the newest complete tag (for people; resuming scans the tags)
        latest                  the same, for DeepSpeed's own tools (zero_to_fp32.py)
        zero_to_fp32.py         DeepSpeed's script: full fp32 weights out of a ZeRO checkpoint

DeepSpeed writes its `latest` before the ranks have finished writing (issues #1793, #5405), so a
crash can leave it naming a half-written tag. Here every rank writes, all meet, rank 0 checks that
each rank's files are on disk and only then writes the tag's completion marker (listing every file
and its size) and moves the pointers. Resuming takes the newest tag whose marker exists and whose
files are all present with the recorded sizes; the pointers are not trusted (a crash between marker
and pointer leaves them one save behind). The checkpoints folder must be on a filesystem every rank
sees (as DeepSpeed's own loading assumes).

A save that cannot be written (disk full, no permission: on any rank) does not end the run: every
rank learns of it, the partial tag is deleted and `save` returns None; the next save tries again
(the learner counts these, and ends non-zero when its final save fails). The error reported is the
system's own (`explain_write_error`); `probe_writable` lets the learner refuse to start where no
checkpoint could ever be written.

client_state (step, version, env steps, EMA, config) is stored under one key of DeepSpeed's state
file, so `load` hands it back without DeepSpeed's own keys; every rank's random generators under
another, and `load` restores each rank's own. State files are read with torch.load(weights_only=True):
a checkpoint that holds an arbitrary pickled object (which could run code when unpickled) is refused.

A checkpoint is resumed only as it was trained: `load` refuses one whose weights, optimizer state
or EMA weights hold NaN or inf (naming the file, and the newest earlier complete checkpoint), and
one whose recorded config sets a FIXED_ON_RESUME key (the policy's shape and action interface)
otherwise than the resumed run's. Finding a checkpoint and reading its recorded config need no
torch (`recorded_config`), so `asyncvla train` checks a resume before any rank starts
(launch/preflight.py); torch is imported where tensors are read.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np

from asyncvla.common.config import ConfigError, structural_keys, to_dict

log = logging.getLogger("asyncvla.learner")

from asyncvla.common.rundir import CHECKPOINTS  # noqa: E402  (the run layout's one name for it)
MARKER = "COMPLETE.json"
POINTER = "latest_complete"
CLIENT_KEY = "asyncvla_client_state"
RNG_KEY = "asyncvla_rng_states"          # {rank: rng_state()} of the ranks whose state file it is
# Globals a state file may name beyond tensors and plain containers: DeepSpeed's optimizer shards
# hold its loss scaler, ZeRO stage and (ZeRO-1/2) fragment addresses; RNG states of older
# checkpoints hold numpy arrays. A DeepSpeed version that writes more needs them added here.
SAFE_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
    "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype"})
TAG_RE = re.compile(r"^step_(\d{8,})$")
# Config keys a resumed run cannot change: they set the policy's parameter shapes or its action
# interface, and a resumed run trains the checkpoint's policy (RUN/policy_init) whatever they say.
# Declared on the config's fields (`opt(..., structural=True)`).
FIXED_ON_RESUME = tuple(structural_keys())


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed, phrased for the user: which one, why, what to do.
    `refused`: a checkpoint found unusable as it loaded (damaged, non-finite), and `instead` the
    newest complete one saved before it (None: none), which the learner records as the one to
    resume from; both None when the problem lies in the config, not in the checkpoint."""

    def __init__(self, message: str, refused: Path | None = None, instead: Path | None = None):
        super().__init__(message)
        self.refused, self.instead = refused, instead


def tag_name(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------------------ save
def save(engine, run_dir, step: int, client_state: dict, keep_last: int = 3, final: bool = False) -> Path | None:
    """Save a checkpoint of every rank (a collective: all ranks call it) and mark it complete.

    Returns the tag directory, complete on every rank; then all but the newest `keep_last` complete
    tags (and any incomplete leftovers) are deleted. Returns None on every rank when any rank could
    not write its part (disk full, permission, ...): the error is logged, the partial tag deleted,
    and the caller goes on (the next save tries again; a `final` one ends the run non-zero).
    """
    import torch.distributed as dist

    from asyncvla.learner.collectives import from_rank0, gather
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(run_dir) / CHECKPOINTS
    tag = tag_name(step)
    tag_dir = root / tag
    t0 = time.perf_counter()
    problem = from_rank0(_prepare(root, tag_dir, keep_last) if rank == 0 else None)
    if problem is not None:                        # all go into DeepSpeed's collective save, or none
        return _failed(tag_dir, rank, problem, final)

    errors: list[str] = []
    with _write_errors_kept(engine, errors):
        engine.save_checkpoint(str(root), tag=tag, save_latest=False,
                               client_state={CLIENT_KEY: client_state, RNG_KEY: _rng_states(engine, rank, world)})
    engine._asyncvla_saved = True       # see load(): ZeRO-3 cannot load into an engine that saved
    written = errors[0] if errors else _own_files(engine, root, tag)
    if not errors:
        try:
            for name in written:
                _fsync(tag_dir / name)   # on disk before the marker can claim they are
        except OSError as e:
            written = _first_line(e)
    reports = gather(written)                      # every rank's files, or why it has none
    verdict = from_rank0(_commit(engine, tag_dir, reports, step, world, keep_last) if rank == 0 else None)
    if verdict is not None:
        return _failed(tag_dir, rank, verdict, final)
    log.info("checkpoint %s complete (%.2f s)", tag_dir, time.perf_counter() - t0)
    return tag_dir


def _prepare(root: Path, tag_dir: Path, keep_last: int) -> str | None:
    """Rank 0, before the save: an empty place for the tag and room for it. None, or the problem."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():        # left by an earlier branch of this run: never mix two saves
            _remove_tag(tag_dir)
        make_room(root, keep_last)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _commit(engine, tag_dir: Path, reports: list, step: int, world: int, keep_last: int) -> str | None:
    """Rank 0, after every rank wrote: mark the tag complete and prune, or delete it. None, or
    the reason the tag was deleted."""
    problem = _check_written(tag_dir, reports)
    if problem is None:
        try:
            mark_complete(tag_dir, [name for r in reports for name in r], step=step, world_size=world,
                          zero_stage=engine.zero_optimization_stage(), bf16=engine.bfloat16_enabled())
        except OSError as e:
            if check_complete(tag_dir) is not None:      # a marker on disk commits the tag
                problem = f"the completion marker could not be written: {type(e).__name__}: {e}"
            else:
                log.warning("checkpoint %s complete but its pointers not moved (%s)", tag_dir, e)
    if problem is not None:
        _remove_tag(tag_dir)
        return problem
    try:
        prune(tag_dir.parent, keep=keep_last, current=tag_dir.name)
    except OSError as e:
        log.warning("old checkpoints could not be deleted: %s", e)
    return None


def _failed(tag_dir: Path, rank: int, problem: str, final: bool) -> None:
    if rank == 0:
        latest = _complete_tags(tag_dir.parent)
        with contextlib.suppress(OSError):
            problem += f"; {shutil.disk_usage(tag_dir.parent).free / 1e9:.2f} GB free there"
        what = ("the final save: the run ends non-zero" if final
                else "a periodic save: training goes on, the next save tries again")
        log.error("checkpoint %s NOT saved (%s); deleted what was written (%s); newest complete checkpoint: %s",
                  tag_dir, problem, what, latest[-1].name if latest else "none")
    return None


@contextlib.contextmanager
def _write_errors_kept(engine, errors: list):
    """Inside, a failed file write of DeepSpeed's save is recorded in `errors` instead of raised.
    Its save is a collective: a rank that raised out of it would skip the barrier the others wait
    in. torch.save reports a full disk as a RuntimeError ("file write failed"), a missing
    folder as one too; the open itself as an OSError."""
    def kept(write):
        def call(*args, **kwargs):
            try:
                return write(*args, **kwargs)
            except (OSError, RuntimeError) as e:
                errors.append(explain_write_error(e))
        return call

    # every shard and states file; rank 0's copy of zero_to_fp32.py
    targets = [(engine.checkpoint_engine, "save"), (engine, "_copy_recovery_script")]
    before = [vars(obj).get(name) for obj, name in targets]
    for obj, name in targets:
        setattr(obj, name, kept(getattr(obj, name)))
    try:
        yield
    finally:
        for (obj, name), own in zip(targets, before):
            if own is None:
                delattr(obj, name)                  # the class's method again
            else:
                setattr(obj, name, own)


_NO_PARENT = re.compile(r"Parent directory (.+) does not exist\.?$")


def explain_write_error(e: Exception) -> str:
    """The first line of a failed write, with the system's own reason where torch.save hides it:
    when DeepSpeed could not make a tag's folder (read-only, not a directory, ...) it only logs
    that, and torch.save then reports "Parent directory ... does not exist". Making that folder
    here gives the real error."""
    text = _first_line(e)
    missing = _NO_PARENT.search(text)
    if missing is None:
        return text
    try:
        os.makedirs(missing.group(1), exist_ok=True)
    except OSError as real:
        return f"{type(real).__name__}: {real}"
    return text


def probe_writable(root) -> str | None:
    """None when a file can be written (and synced) in `root`, made if missing; else the system's
    reason. Each process writes its own probe file, which it removes."""
    probe = Path(root) / f".write_probe.{os.getpid()}"
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        _write_atomic(probe, "asyncvla write probe\n")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _rng_states(engine, rank: int, world: int) -> dict:
    """{rank: rng_state()} for the state file(s) DeepSpeed writes: under ZeRO-3 each rank writes
    its own and keeps its own generators there; otherwise rank 0's file alone carries every rank's."""
    own = rng_state()
    if engine.zero_optimization_partition_weights():
        return {rank: own}
    from asyncvla.learner.collectives import gather
    return dict(enumerate(gather(own)))


def make_room(root: Path, keep: int) -> None:
    """When the free space would not hold another checkpoint the size of the newest one (+10 %),
    delete ahead of the save what pruning after it would delete: incomplete leftovers and all but
    the newest `keep` - 1 complete tags. The newest complete tag is never deleted before a new one
    is complete, so with keep=1 a save that does not fit fails instead."""
    complete = _complete_tags(root)
    if not complete:
        return
    need = int(_tag_bytes(complete[-1]) * 1.1)
    if shutil.disk_usage(root).free >= need:
        return
    doomed = [d for d in _tag_dirs(root) if d not in complete] + complete[:-max(keep - 1, 1)]
    for d in doomed:
        _remove_tag(d)
        log.warning("deleted checkpoint %s before the save to make room", d)
    free = shutil.disk_usage(root).free
    if free < need:
        log.warning("only %.2f GB free in %s, the last checkpoint took %.2f GB: this save may fail",
                    free / 1e9, root, need / 1.1e9)


def _tag_bytes(tag_dir: Path) -> int:
    return sum(read_marker(tag_dir)["files"].values())


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
    """None if every rank reported its files (and they are there), else what went wrong where."""
    failed = [f"rank {r}: {names}" for r, names in enumerate(reports) if isinstance(names, str)]
    if failed:
        return "; ".join(failed)
    for r, names in enumerate(reports):
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
    with contextlib.suppress(OSError):
        (tag_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a written file to disk; an error means it may not be there (full disk, I/O error)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:
        pass                              # some filesystems cannot sync a directory


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)               # make the rename itself durable


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
    complete = _complete_tags(root)          # not the pointer: it may be a save behind the markers
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
    """Complete tags, oldest first by save time: within a run that is step order, but a run resumed
    from an older tag saves lower steps later, and those are its newest."""
    done = [d for d in _tag_dirs(root) if check_complete(d) is None]
    return sorted(done, key=_save_order)


def adopt(tag_dir) -> list[Path]:
    """Make a checkpoint being resumed its run's newest (rank 0, before the run saves anything).
    Resuming from an older checkpoint starts a new branch: the complete checkpoints saved after it
    belong to the branch it leaves, and would otherwise stay "newest" until this run saves, so
    that a stop before then would name them and `--resume RUN` continue them. They move to
    checkpoints/abandoned/<time>/ (kept, not deleted), and the pointers name `tag_dir`. Returns
    where they went."""
    tag_dir = Path(tag_dir)
    root = tag_dir.parent
    later = [d for d in _complete_tags(root) if _save_order(d) > _save_order(tag_dir)]
    if not later:
        return []
    folder = root / "abandoned" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    moved = []
    for d in later:
        (d / MARKER).rename(d / f"{MARKER}.abandoned")   # first: half-moved, it must not look complete
        target = folder / d.name
        d.rename(target)
        (target / f"{MARKER}.abandoned").rename(target / MARKER)
        moved.append(target)
    _write_atomic(root / POINTER, tag_dir.name)
    _write_atomic(root / "latest", tag_dir.name)
    return moved


def _save_order(tag_dir: Path) -> tuple:
    return read_marker(tag_dir).get("saved_at", 0.0), tag_dir.name


def _alternatives(root: Path) -> str:
    complete = _complete_tags(root)
    return f"; complete ones: {', '.join(d.name for d in complete[-3:])}" if complete else ""


# ------------------------------------------------------------------------------------------ load
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
        problem = _check_compatible(engine, tag_dir, dist.get_world_size()) or \
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
        raise CheckpointError(problem, refused, _earlier_complete(refused) if refused is not None else None)


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
            earlier = _earlier_complete(tag_dir)
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


def _earlier_complete(tag_dir: Path) -> Path | None:
    """The newest complete checkpoint beside `tag_dir` saved before it, or None."""
    return next((d for d in reversed(_complete_tags(tag_dir.parent)) if _save_order(d) < _save_order(tag_dir)),
                None)


def check_resume_config(tag_dir, config) -> str | None:
    """None when `config` (a Config) sets every FIXED_ON_RESUME key as the config recorded in the
    checkpoint at `tag_dir` (or none is recorded), else one line naming each key and both values."""
    recorded = recorded_config(tag_dir)
    changed = structural_changes(recorded, to_dict(config)) if recorded is not None else []
    if not changed:
        return None
    return (f"checkpoint '{tag_dir}' was trained with {', '.join(changed)}; a resumed run trains the "
            "checkpoint's policy, whose shape and action interface these keys set: resume with its values, "
            "or start a new run (another logging.experiment_name)")


def structural_changes(recorded: dict, config: dict) -> list[str]:
    """'key=recorded (this config: value)' for each FIXED_ON_RESUME key that the config dict `config`
    sets otherwise than `recorded` (both as `to_dict` gives them). Keys that `recorded` lacks (an
    older version wrote it) are not compared."""
    old, new = _flat(recorded), _flat(config)
    return [f"{k}={old[k]!r} (this config: {new[k]!r})" for k in old
            if _fixed_on_resume(k) and k in new and old[k] != new[k]]


def _fixed_on_resume(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in FIXED_ON_RESUME)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def recorded_config(ckpt_dir) -> dict | None:
    """The config recorded in the client_state of a complete checkpoint (None: none recorded), read
    without torch and without importing anything the file names: a state file is a zip whose
    data.pkl holds its objects, and only plain containers and values are rebuilt from it (see
    _Skeleton). Raises CheckpointError like `load`."""
    path = _rank0_states(resolve(ckpt_dir))
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))      # <archive>/data.pkl
            state = _Skeleton(io.BytesIO(z.read(pkl))).load()
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{path}' could not be read: {_first_line(e)}") from None
    client = state.get(CLIENT_KEY) if isinstance(state, dict) else None
    config = client.get("config") if isinstance(client, dict) else None
    return config if isinstance(config, dict) else None


class _Stub:
    """Stands in for every object a state file names (a tensor, a storage, DeepSpeed's classes):
    made from anything, holding nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


class _Skeleton(pickle.Unpickler):
    """Rebuilds a pickle's plain containers and values; every global it names is a _Stub (nothing is
    imported, so nothing runs) and every storage a tensor would read from disk is one too."""

    def find_class(self, module, name):
        return _Stub

    def persistent_load(self, pid):
        return _Stub()


def read_client_state(ckpt_dir) -> dict:
    """The client_state of a complete checkpoint, read from rank 0's file without an engine
    (tensors on the CPU). Raises CheckpointError like `load`."""
    tag_dir = resolve(ckpt_dir)
    state = load_file(_rank0_states(tag_dir))
    if CLIENT_KEY not in state:
        raise CheckpointError(f"checkpoint '{tag_dir}' holds no training state of this program "
                              f"(key '{CLIENT_KEY}' missing)")
    return state[CLIENT_KEY]


def _rank0_states(tag_dir: Path) -> Path:
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"checkpoint '{tag_dir}' has no rank-0 model states file")
    return files[0]


def load_file(path) -> dict:
    """One state file of a checkpoint, tensors on the CPU, read with weights_only=True: tensors,
    plain values and the few SAFE_GLOBALS only. Raises CheckpointError naming the file and what is
    wrong (an arbitrary pickled object is refused before anything is unpickled)."""
    import torch

    try:
        with torch.serialization.safe_globals(check_pickle(path)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{path}' could not be read: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).split("WeightsUnpickler error:")[-1]           # torch's own words, after its preamble
    return f"{type(e).__name__}: {(text.strip().splitlines() or [''])[0]}"


def check_pickle(path) -> list:
    """The SAFE_GLOBALS that the state file at `path` names (for torch.serialization.safe_globals),
    or a CheckpointError if it names anything else: a checkpoint of this program never does, and
    unpickling it could run any code. Reads the pickle only, not the tensors; a file that is no
    torch file raises what torch raises."""
    import torch

    named = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    refused = sorted(named - SAFE_GLOBALS)
    if refused:
        raise CheckpointError(f"checkpoint file '{path}' holds pickled objects of {', '.join(refused)}, which "
                              "a checkpoint of this program never does; refusing to load it (unpickling "
                              "could run code)")
    allowed = [getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
               for name in sorted(named)]
    if "numpy.dtype" in named:          # the uint32 keys of older RNG states: built, not named
        allowed.append(type(np.dtype(np.uint32)))
    return allowed


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
