"""Whether a checkpoint can be resumed by this run: at the world size and ZeRO stage that wrote it,
and with the config keys that shape the policy (FIXED_ON_RESUME) as it recorded them."""

from __future__ import annotations

from pathlib import Path

from asyncvla.common.config import structural_keys, to_dict

from .layout import read_marker
from .state_files import recorded_config

# Config keys a resumed run cannot change: they set the policy's parameter shapes or its action
# interface, and a resumed run trains the checkpoint's policy (RUN/policy_init) whatever they say.
# Declared on the config's fields (`opt(..., structural=True)`).
FIXED_ON_RESUME = tuple(structural_keys())


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


def check_compatible(engine, tag_dir: Path, world: int) -> str | None:
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
