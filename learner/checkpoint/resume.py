"""Which checkpoint a run resumes from: the newest complete one under a path (never a half-written
or damaged tag; the pointers are not trusted, as a crash between marker and pointer leaves them one
save behind), and the branch a resumed older checkpoint starts. All without torch, so `asyncvla
train` checks a resume before any rank starts (launch/preflight.py)."""

from __future__ import annotations

import time
from pathlib import Path

from .layout import CHECKPOINTS, MARKER, POINTER, TAG_RE, CheckpointError, check_complete, read_marker, tag_name, write_atomic


def resolve(path) -> Path:
    """The checkpoint to resume from `path` (a run dir, its checkpoints dir, or one tag dir), or a
    CheckpointError that says why there is none."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{path}' does not exist")
    if looks_like_tag(p):
        reason = check_complete(p)
        if reason:
            raise CheckpointError(f"checkpoint '{p}' cannot be resumed: {reason}"
                                  + _alternatives(p.parent))
        return p
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    complete = complete_tags(root)          # not the pointer: it may be a save behind the markers
    if complete:
        return complete[-1]
    found = tag_dirs(root)
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


def looks_like_tag(p: Path) -> bool:
    return p.is_dir() and ((p / MARKER).exists() or TAG_RE.match(p.name) is not None
                           or any(p.glob("*model_states.pt")))


def tag_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and TAG_RE.match(d.name)),
                  key=lambda d: int(TAG_RE.match(d.name).group(1)))


def complete_tags(root: Path) -> list[Path]:
    """Complete tags, oldest first by save time: within a run that is step order, but a run resumed
    from an older tag saves lower steps later, and those are its newest."""
    done = [d for d in tag_dirs(root) if check_complete(d) is None]
    return sorted(done, key=save_order)


def adopt(tag_dir) -> list[Path]:
    """Make a checkpoint being resumed its run's newest (rank 0, before the run saves anything).
    Resuming from an older checkpoint starts a new branch: the complete checkpoints saved after it
    belong to the branch it leaves, and would otherwise stay "newest" until this run saves, so
    that a stop before then would name them and `--resume RUN` continue them. They move to
    checkpoints/abandoned/<time>/ (kept, not deleted), and the pointers name `tag_dir`. Returns
    where they went."""
    tag_dir = Path(tag_dir)
    root = tag_dir.parent
    later = [d for d in complete_tags(root) if save_order(d) > save_order(tag_dir)]
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
    write_atomic(root / POINTER, tag_dir.name)
    write_atomic(root / "latest", tag_dir.name)
    return moved


def save_order(tag_dir: Path) -> tuple:
    return read_marker(tag_dir).get("saved_at", 0.0), tag_dir.name


def _alternatives(root: Path) -> str:
    complete = complete_tags(root)
    return f"; complete ones: {', '.join(d.name for d in complete[-3:])}" if complete else ""


def earlier_complete(tag_dir: Path) -> Path | None:
    """The newest complete checkpoint beside `tag_dir` saved before it, or None."""
    return next((d for d in reversed(complete_tags(tag_dir.parent)) if save_order(d) < save_order(tag_dir)),
                None)
