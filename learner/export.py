"""A trained policy out of the training system: loaded from a checkpoint, or exported for deployment.

    policy, cfg, source = load_policy(path)      # an export (policy.json) or a training checkpoint
    info = export_policy(checkpoint, out_dir)    # -> a directory VLAPolicy.from_pretrained loads

A checkpoint (learner/checkpoint/) holds the engine's ZeRO shards, written by every rank, and
rank 0's client_state with the resolved config and the EMA of the published weights. The policy is
rebuilt from the run's policy_init/ (or from the config when that folder is gone) and given
    weights="trained"  every parameter, consolidated to fp32 from the shards by DeepSpeed's own
                       zero_to_fp32 (the learner's weights at the save)
    weights="ema"      the published EMA weights over those (what the actors were running)
Every state file is checked before anything in it is unpickled (`checkpoint.check_pickle`): one that
holds an arbitrary pickled object is refused, since DeepSpeed's zero_to_fp32 unpickles unrestricted.
An export is a `VLAPolicy.save_pretrained` directory (backbone/ with LoRA merged in, or adapter/
with --keep-lora; heads.safetensors with the value head; policy.json with the action-token spec)
plus config.yaml (the run's resolved config, so `eval` knows the env), export.json (where it came
from) and, optionally, policy_state_dict.pt (one plain torch file for deployment scripts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from pathlib import Path

import torch

from asyncvla.common.config import Config, ConfigError, from_dict, load_config, to_yaml
from asyncvla.common.policy import VLAPolicy, kinds
from asyncvla.learner import checkpoint
from asyncvla.learner.checkpoint import CheckpointError

WEIGHTS = ("trained", "ema")
CONFIG_FILE = "config.yaml"
EXPORT_INFO = "export.json"
STATE_DICT_FILE = "policy_state_dict.pt"
STATE_DICT_FORMAT = "asyncvla-vla-policy-state-dict"


def load_policy(path, weights: str = "trained", device="cpu") -> tuple[VLAPolicy, Config | None, dict]:
    """(policy, config or None, source info) from an export directory or a training checkpoint.
    Every problem raises a ConfigError (CheckpointError for the files) naming the path and what is wrong."""
    p = Path(path)
    if (p / "policy.json").is_file():
        if weights != "trained":
            raise ConfigError(f"'{p}' is a policy export with one set of weights; weights={weights!r} "
                              "applies to training checkpoints only")
        try:
            policy = kinds.load_policy(p, device=device)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"policy export '{p}' cannot be loaded: {e}") from None
        cfg = load_config(p / CONFIG_FILE) if (p / CONFIG_FILE).is_file() else None
        return policy, cfg, {"kind": "export", "path": str(p)}
    return load_checkpoint(path, weights, device)


def load_checkpoint(path, weights: str = "trained", device="cpu",
                    dtype: torch.dtype | None = None) -> tuple[VLAPolicy, Config, dict]:
    """The policy of a complete checkpoint (a run dir, its checkpoints/ dir or one tag dir), in
    `dtype` (default: policy.precision on `device`)."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r} is not allowed; choose one of {list(WEIGHTS)}")
    tag_dir = checkpoint.resolve(path)
    state = checkpoint.read_client_state(tag_dir)
    try:
        cfg = from_dict(state["config"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint '{tag_dir}' holds no config in its training state ({e})") from None
    policy = _base_policy(tag_dir, cfg, device, dtype)
    full = consolidate(tag_dir)
    own = policy.state_dict().keys()
    missing, unexpected = sorted(own - full.keys()), sorted(full.keys() - own)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint '{tag_dir}' does not fit the policy of its config: "
                              f"{len(missing)} tensors missing (e.g. {missing[:2]}), {len(unexpected)} "
                              f"unexpected (e.g. {unexpected[:2]})")
    policy.load_state_dict(full)
    if weights == "ema":
        shadow = (state.get("ema") or {}).get("shadow")
        if not shadow:
            raise CheckpointError(f"checkpoint '{tag_dir}' holds no EMA weights; use the trained ones")
        policy.load_trainable_state_dict(shadow)
    info = {"kind": "checkpoint", "path": str(tag_dir), "step": state.get("step"),
            "version": state.get("version"), "weights": weights}
    return policy, cfg, info


def consolidate(tag_dir) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's module as a full fp32 CPU tensor, from all ranks' files."""
    tag_dir = Path(tag_dir)
    meta = checkpoint.read_marker(tag_dir)
    try:
        for name in meta["files"]:          # DeepSpeed's zero_to_fp32 unpickles them unrestricted
            checkpoint.check_pickle(tag_dir / name)
        if meta.get("zero_stage", 3) == 0:       # no ZeRO: rank 0's file holds the whole module
            files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
            module = checkpoint.load_file(files[0])["module"]
            return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
        with contextlib.redirect_stdout(sys.stderr):        # its import logs to stdout
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        # It prints a line per step and draws progress bars: noise around a one-line error.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except CheckpointError:
        raise
    except Exception as e:
        last = (str(e).strip().splitlines() or [""])[-1]
        raise CheckpointError(f"checkpoint '{tag_dir}': its ZeRO shards could not be consolidated "
                              f"({type(e).__name__}: {last})") from None


def _base_policy(tag_dir: Path, cfg: Config, device, dtype) -> VLAPolicy:
    """The run's initial policy (its architecture, tokenizer and image spec), which the
    checkpoint's weights then replace."""
    init = tag_dir.resolve().parents[1] / "policy_init"          # <run>/checkpoints/<tag>
    try:
        if (init / "policy.json").is_file():
            return kinds.load_policy(init, device=device, dtype=dtype)
        return kinds.build_policy(cfg.policy, device=device, dtype=dtype)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the policy of checkpoint '{tag_dir}' cannot be rebuilt: {e}") from None


# ------------------------------------------------------------------------------------------ export
def export_policy(path, out_dir, keep_lora: bool = False, weights: str = "trained",
                  state_dict: bool = False, fmt: str = "asyncvla") -> dict:
    """Write a standalone policy directory from a checkpoint; returns what was written. fmt
    "lerobot": LeRobot's own directory of a policy that has one (a SmolVLA), beside config.yaml."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export directory '{out}' exists and is not empty; give a new or empty one")
    policy, cfg, info = load_checkpoint(path, weights, dtype=torch.float32)   # full precision, any config
    if fmt == "lerobot":
        if not hasattr(policy, "export_lerobot"):
            raise ConfigError(f"--format lerobot: the policy of '{path}' has no LeRobot format (a SmolVLA loaded "
                              "from a LeRobot directory has); export it as asyncvla's")
        policy.export_lerobot(out)
        (out / CONFIG_FILE).write_text(to_yaml(cfg))
        info.update(lora="none", format="lerobot")
        (out / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        info["files"] = {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()}
        return info
    if not keep_lora:
        merge_lora(policy)
    policy.save_pretrained(str(out))
    (out / CONFIG_FILE).write_text(to_yaml(cfg))
    info.update(lora="adapter" if policy.cfg.is_lora else ("merged" if cfg.policy.is_lora else "none"))
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    if state_dict:
        meta = json.loads((out / "policy.json").read_text())
        torch.save({"format": STATE_DICT_FORMAT, "policy": meta,
                    "state_dict": {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}},
                   out / STATE_DICT_FILE)
    info["files"] = {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()}
    return info


def merge_lora(policy: VLAPolicy) -> None:
    """Fold the LoRA adapters into the backbone's weights (peft merge_and_unload): a plain VLM, and
    policy.cfg.is_lora turns false so that the saved policy loads without adapter files."""
    from peft import PeftModel

    if isinstance(getattr(policy, "backbone", None), PeftModel):      # (a kind without a VLM backbone: none)
        policy.backbone = policy.backbone.merge_and_unload()
        policy.cfg = dataclasses.replace(policy.cfg, is_lora=False)
