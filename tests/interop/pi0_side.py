"""The parameters of LeRobot 0.4.3's own PI0Policy and PI05Policy at π0's and π0.5's published
shape, built on the meta device, for checking asyncvla's π0 network without LeRobot installed.
Runs in the interop environment only (`make interop-env`), offline:

    HF_HUB_OFFLINE=1 .venv-interop/bin/python tests/interop/pi0_side.py count OUT_DIR

OUT_DIR (tests/golden/pi0) then holds pi0_params.json and pi05_params.json: the count, in all and
by part, every parameter's name and shape (named_parameters: a tied tensor under its first name),
the names state_dict adds for tied tensors, the config the policy was built from
(common/policy/pi0/released.py's PI0_BASE / PI05_BASE, read from that file, nothing else of ours)
and the library versions.

Two things are done here that LeRobot does not do, only to get the class built on PyPI's
transformers (4.57) instead of LeRobot's patched one (openpi's transformers_replace):

  1. A stub module `transformers.models.siglip.check`, whose
     check_whether_transformers_replace_is_installed_correctly() returns True, is put into
     sys.modules before the policy is built. PI0Pytorch.__init__ imports it only to refuse an
     unpatched transformers; nothing else reads it. It exists in this process only.
  2. For π0.5 (use_adarms=[False, True]), the action expert's RMS norms are swapped after the build
     for a copy of openpi's patched GemmaRMSNorm with cond_dim (a `dense` Linear(cond_dim, 3 x
     width) and no `weight`), which is what the patched GemmaDecoderLayer / GemmaModel build when
     config.use_adarms is set: PyPI's Gemma ignores use_adarms and would build plain norms. The
     swap touches exactly the expert's input_layernorm, post_attention_layernorm (each layer) and
     model.norm; π0 (no adaRMS) is built untouched.

Everything else (PaliGemmaForConditionalGeneration and GemmaForCausalLM from LeRobot's own configs,
the expert's embed_tokens set to None, the projections) is LeRobot's code as installed.
config.device is set to "meta" after the config's own checks (PI0Policy moves its model to
config.device, and a meta tensor cannot be copied to "cpu").
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn

RELEASED = Path(__file__).resolve().parents[2] / "common" / "policy" / "pi0" / "released.py"


def released_configs() -> dict:
    spec = importlib.util.spec_from_file_location("pi0_released", RELEASED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return copy.deepcopy(module.RELEASED), copy.deepcopy(module.PARTS)


def stub_siglip_check() -> None:
    """(1) above."""
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    sys.modules["transformers.models.siglip.check"] = check
    import transformers.models.siglip as siglip
    siglip.check = check


class PatchedGemmaRMSNorm(nn.Module):
    """openpi's transformers_replace GemmaRMSNorm, its parameters (the adaptive branch): (2) above."""

    def __init__(self, dim: int, eps: float = 1e-6, cond_dim: int | None = None):
        super().__init__()
        self.eps, self.dim, self.cond_dim = eps, dim, cond_dim
        if cond_dim is not None:
            self.dense = nn.Linear(cond_dim, dim * 3, bias=True)
        else:
            self.weight = nn.Parameter(torch.zeros(dim))
            self.dense = None


def adarms_expert(expert) -> int:
    """(2) above: swaps the expert's norms when its config asks for adaRMS; how many were swapped."""
    config = expert.config
    if not getattr(config, "use_adarms", False):
        return 0
    cond, swapped = config.adarms_cond_dim, 0
    for layer in expert.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, PatchedGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, cond))
            swapped += 1
    expert.model.norm = PatchedGemmaRMSNorm(config.hidden_size, config.rms_norm_eps, cond)
    return swapped + 1


def build(kind: str, config_json: dict):
    import dataclasses

    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    if kind == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(config_json) - fields - {"type"})
    assert not unknown, f"{kind} keys {Config.__name__} does not have: {unknown}"
    features = lambda d: {k: PolicyFeature(type=FeatureType[f["type"]], shape=tuple(f["shape"]))  # noqa: E731
                          for k, f in d.items()}
    kwargs = {k: v for k, v in config_json.items() if k != "type"} | {
        "input_features": features(config_json["input_features"]),
        "output_features": features(config_json["output_features"]),
        "normalization_mapping": {k: NormalizationMode(v) for k, v in config_json["normalization_mapping"].items()},
        "image_resolution": tuple(config_json["image_resolution"]), "device": "cpu"}
    config = Config(**kwargs)
    config.device = "meta"
    with torch.device("meta"):
        policy = Policy(config)
        swapped = adarms_expert(policy.model.paligemma_with_expert.gemma_expert)
    return policy, swapped


def count(out_dir: Path) -> None:
    import lerobot
    import transformers

    stub_siglip_check()
    configs, parts = released_configs()
    for kind, config_json in configs.items():
        policy, swapped = build(kind, config_json)
        assert all(p.is_meta for p in policy.parameters())
        named = [(k.removeprefix("model."), p) for k, p in policy.named_parameters()]
        all_names = {k.removeprefix("model.") for k in policy.state_dict()}
        tied = sorted(all_names - {k for k, _ in named})
        counts = dict.fromkeys(("total", *parts, "projections"), 0)
        for name, p in named:
            counts["total"] += p.numel()
            counts[next((k for k, pre in parts.items() if name.startswith(pre)), "projections")] += p.numel()
        pg = policy.model.paligemma_with_expert.paligemma
        ids = {id(p): k for k, p in named}
        tied_to = {k: ids[id(policy.state_dict(keep_vars=True)["model." + k])] for k in tied}
        result = {
            "description": f"Parameters of LeRobot {lerobot.__version__}'s {type(policy).__name__} at lerobot/"
                           f"{kind}_base's shape, built on the meta device from `config` (released.py's), with "
                           "the stub and (for pi05) the adaRMS norm swap tests/interop/pi0_side.py's docstring "
                           "describes. `parameters`: named_parameters without the 'model.' prefix, sorted (a tied "
                           "tensor under its first name); `tied`: the other names state_dict gives those tensors; "
                           "`counts`: numbers of parameters by name prefix (released.py's PARTS, the rest "
                           "'projections').",
            "written_by": "tests/interop/pi0_side.py count",
            "counts": counts,
            "tensors": len(named),
            "parameters": sorted([k, list(p.shape)] for k, p in named),
            "tied": tied_to,
            "adarms_norms_swapped": swapped,
            "lm_head_tied_to_embed_tokens": pg.lm_head.weight is pg.model.language_model.embed_tokens.weight,
            "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": sys.version.split()[0]},
            "config": config_json,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{kind}_params.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{kind}: {counts['total']:,} parameters {counts}; {len(named)} tensors, tied {tied_to}; "
              f"adaRMS norms swapped: {swapped}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "count":
        count(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
