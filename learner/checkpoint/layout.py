"""The on-disk layout of a run's checkpoints, and the durable writes it is made with.

    <run>/checkpoints/
        step_00000050/          DeepSpeed's files of one save (every rank's shards) + COMPLETE.json
        latest_complete         name of the newest complete tag (for people; resuming scans the tags)
        latest                  the same, for DeepSpeed's own tools (zero_to_fp32.py)
        zero_to_fp32.py         DeepSpeed's script: full fp32 weights out of a ZeRO checkpoint

A tag is complete when its marker exists and lists every file with the size it has on disk.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from asyncvla.common.config import ConfigError
from asyncvla.common.rundir import CHECKPOINTS  # noqa: F401  (the run layout's one name for it)

MARKER = "COMPLETE.json"
POINTER = "latest_complete"
CLIENT_KEY = "asyncvla_client_state"
RNG_KEY = "asyncvla_rng_states"          # {rank: rng_state()} of the ranks whose state file it is
TAG_RE = re.compile(r"^step_(\d{8,})$")


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


def fsync(path: Path) -> None:
    """Flush a written file to disk; an error means it may not be there (full disk, I/O error)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync(path)
    except OSError:
        pass                              # some filesystems cannot sync a directory


def write_atomic(path: Path, text: str) -> None:
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
    fsync_dir(path.parent)               # make the rename itself durable


def first_line(e: Exception) -> str:
    text = str(e).split("WeightsUnpickler error:")[-1]           # torch's own words, after its preamble
    return f"{type(e).__name__}: {(text.strip().splitlines() or [''])[0]}"
