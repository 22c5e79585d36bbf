"""Where a run keeps its files: the one rule every process (launcher, learner, evaluator, SFT,
pipeline) uses to find its run directory.

    RUN = logging.output_dir / logging.experiment_name          a new run
    RUN = the run that holds checkpoint.resume                  a resumed run, whichever of
                                                                RUN, RUN/checkpoints or
                                                                RUN/checkpoints/step_N it names
Inside RUN: checkpoints/, tb/, eval/, policy_init/, config.yaml, launch_config.yaml, sft/, demos/,
learner_end.json (how the learner's last run ended: `write_end` / `read_end`), actors.json (who
is registered with it now: `write_actors` / `read_actors`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHECKPOINTS = "checkpoints"
LEARNER_END = "learner_end.json"
ACTORS = "actors.json"          # the actor ids registered with the learner now (rank 0 keeps it current)
# Why a learner ended: its budget (learner.max_steps / max_env_steps / max_time_s), a stop signal,
# or a failure (non-finite training, a final checkpoint not written).
END_REASONS = ("budget", "stopped", "failed")


def run_dir(cfg) -> Path:
    """The run directory of `cfg` (see the module docstring)."""
    if cfg.checkpoint.resume:
        return run_dir_of(cfg.checkpoint.resume)
    return Path(cfg.logging.output_dir) / cfg.logging.experiment_name


def run_dir_of(path) -> Path:
    """The run directory that holds `path`: a run directory, its checkpoints folder, or one
    checkpoint in it."""
    p = Path(path).resolve()
    if p.parent.name == CHECKPOINTS:        # RUN/checkpoints/step_N
        return p.parents[1]
    if p.name == CHECKPOINTS:               # RUN/checkpoints
        return p.parent
    return p


def write_end(run_dir, reason: str, step: int, checkpoint, checkpoint_step: int | None,
              signum: int | None = None) -> None:
    """Record how the learner ended (rank 0, last thing before it exits): `reason` (END_REASONS),
    the step it reached, and the checkpoint that holds the newest step of this run's branch (None:
    nothing saved yet). The launcher reads it: an exit code alone cannot tell a budget's end from
    a stop. Written whole (temporary file + rename)."""
    assert reason in END_REASONS, reason
    path = Path(run_dir) / LEARNER_END
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"reason": reason, "step": step, "signal": signum,
                               "checkpoint": None if checkpoint is None else str(checkpoint),
                               "checkpoint_step": checkpoint_step}, indent=1))
    os.replace(tmp, path)


def read_end(run_dir) -> dict | None:
    """The record `write_end` left, or None (none written, or unreadable)."""
    try:
        record = json.loads((Path(run_dir) / LEARNER_END).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("reason") in END_REASONS else None


def clear_end(run_dir) -> None:
    """Forget the previous run's records before a new learner starts."""
    for name in (LEARNER_END, ACTORS):
        (Path(run_dir) / name).unlink(missing_ok=True)


def write_actors(run_dir, ids: list[str]) -> None:
    """Record the actor ids registered with the learner (whole file: temporary file + rename)."""
    path = Path(run_dir) / ACTORS
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"actors": list(ids)}))
    os.replace(tmp, path)


def read_actors(run_dir) -> list[str] | None:
    """The ids `write_actors` recorded, or None (none written yet, or unreadable)."""
    try:
        ids = json.loads((Path(run_dir) / ACTORS).read_text())["actors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else None
