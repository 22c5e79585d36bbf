"""Where a run keeps its files: the one rule every process (launcher, learner, evaluator, SFT,
pipeline) uses to find its run directory.

    RUN = logging.output_dir / logging.experiment_name          a new run
    RUN = the run that holds checkpoint.resume                  a resumed run, whichever of
                                                                RUN, RUN/checkpoints or
                                                                RUN/checkpoints/step_N it names
Inside RUN: checkpoints/, tb/, eval/, policy_init/, config.yaml, launch_config.yaml, sft/, demos/.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"


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
