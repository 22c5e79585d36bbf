"""Saving a checkpoint that is resumed only when complete, and keeping the last few.

DeepSpeed writes its `latest` before the ranks have finished writing (issues #1793, #5405), so a
crash can leave it naming a half-written tag. Here every rank writes, all meet, rank 0 checks that
each rank's files are on disk and only then writes the tag's completion marker (listing every file
and its size) and moves the pointers.

A save that cannot be written (disk full, no permission: on any rank) does not end the run: every
rank learns of it, the partial tag is deleted and `save` returns None; the next save tries again
(the learner counts these, and ends non-zero when its final save fails). The error reported is the
system's own (`explain_write_error`); `probe_writable` lets the learner refuse to start where no
checkpoint could ever be written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from .layout import (CHECKPOINTS, CLIENT_KEY, MARKER, POINTER, RNG_KEY, check_complete, first_line, fsync,
                     read_marker, tag_name, write_atomic)
from .resume import complete_tags, tag_dirs
from .rng import rng_states

log = logging.getLogger("asyncvla.learner")


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
                               client_state={CLIENT_KEY: client_state, RNG_KEY: rng_states(engine, rank, world)})
    engine._asyncvla_saved = True       # see load(): ZeRO-3 cannot load into an engine that saved
    written = errors[0] if errors else _own_files(engine, root, tag)
    if not errors:
        try:
            for name in written:
                fsync(tag_dir / name)   # on disk before the marker can claim they are
        except OSError as e:
            written = first_line(e)
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
        latest = complete_tags(tag_dir.parent)
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
    text = first_line(e)
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
        write_atomic(probe, "asyncvla write probe\n")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def make_room(root: Path, keep: int) -> None:
    """When the free space would not hold another checkpoint the size of the newest one (+10 %),
    delete ahead of the save what pruning after it would delete: incomplete leftovers and all but
    the newest `keep` - 1 complete tags. The newest complete tag is never deleted before a new one
    is complete, so with keep=1 a save that does not fit fails instead."""
    complete = complete_tags(root)
    if not complete:
        return
    need = int(_tag_bytes(complete[-1]) * 1.1)
    if shutil.disk_usage(root).free >= need:
        return
    doomed = [d for d in tag_dirs(root) if d not in complete] + complete[:-max(keep - 1, 1)]
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
    write_atomic(tag_dir / MARKER, json.dumps({
        "tag": tag_dir.name, "step": step, "world_size": world_size, "zero_stage": zero_stage,
        "bf16": bool(bf16), "saved_at": time.time(), "files": sizes}, indent=1))
    write_atomic(tag_dir.parent / POINTER, tag_dir.name)
    write_atomic(tag_dir.parent / "latest", tag_dir.name)


def prune(root: Path, keep: int, current: str) -> None:
    """Keep the newest `keep` complete tags (the one just written among them); delete older
    complete tags and incomplete leftovers of interrupted saves."""
    complete = complete_tags(Path(root))
    doomed = [t for t in complete[:-max(keep, 1)] if t.name != current]
    doomed += [d for d in tag_dirs(Path(root)) if d.name != current and d not in complete]
    for d in doomed:
        _remove_tag(d)
        log.info("deleted checkpoint %s", d)


def _remove_tag(tag_dir: Path) -> None:
    # The marker goes first: a half-deleted tag must never look complete.
    with contextlib.suppress(OSError):
        (tag_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=True)
