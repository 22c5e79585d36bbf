"""Checkpoints that are only ever resumed when complete: one package, a module per job.

    layout.py       the files of a run's checkpoints, the completion marker, durable writes
    saving.py       save (every rank writes, all meet, rank 0 marks it complete), prune, disk checks
    resume.py       which checkpoint to resume: the newest complete one; a resumed older one's branch
    state_files.py  reading state files safely (weights_only), and the recorded config without torch
    compat.py       whether this run can resume it: world size, ZeRO stage, the policy-shaping keys
    loading.py      loading into a fresh engine, refusing NaN or inf, restoring client state and RNGs
    rng.py          every rank's random generators

The checkpoints folder must be on a filesystem every rank sees (as DeepSpeed's own loading
assumes). Finding a checkpoint and reading its recorded config need no torch, so `asyncvla train`
checks a resume before any rank starts (launch/preflight.py); torch is imported where tensors are
read.
"""

from .compat import FIXED_ON_RESUME, check_resume_config, structural_changes
from .layout import (CHECKPOINTS, CLIENT_KEY, MARKER, POINTER, RNG_KEY, CheckpointError, check_complete,
                     read_marker, tag_name)
from .loading import load
from .resume import adopt, complete_tags, find_latest, resolve
from .rng import rng_state, set_rng_state
from .saving import explain_write_error, make_room, mark_complete, probe_writable, prune, save
from .state_files import SAFE_GLOBALS, check_pickle, load_file, read_client_state, recorded_config

__all__ = ["CHECKPOINTS", "CLIENT_KEY", "FIXED_ON_RESUME", "MARKER", "POINTER", "RNG_KEY", "SAFE_GLOBALS",
           "CheckpointError", "adopt", "check_complete", "check_pickle", "check_resume_config", "complete_tags",
           "explain_write_error", "find_latest", "load", "load_file", "make_room", "mark_complete", "probe_writable",
           "prune", "read_client_state", "read_marker", "recorded_config", "resolve", "rng_state", "save",
           "set_rng_state", "structural_changes", "tag_name"]
