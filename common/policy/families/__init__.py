"""VLM families behind one interface: what the policy needs from a backbone.

    family = family_of(vlm.config)                 # by config.model_type; unknown ones are refused
    feats = family.image_features(vlm, pixels)     # [B, n, H] from normalised pixels [B, 3, s, s]
    out = family.decoder(vlm)(inputs_embeds=..., attention_mask=..., position_ids=..., ...)

One module per family: idefics3 (Idefics3, SmolVLM), paligemma (PaliGemma 1/2, the backbone of
pi0 and pi0.5), qwen2_5_vl (Qwen2.5-VL). Each says how its checkpoint prepares an image (the side
its vision tower takes, from preprocessor_config.json where the family reads one), how many image
tokens a picture gives and where they sit in the prompt, how to run the vision tower and the
language model, how positions are numbered (Qwen2.5-VL: 3-D M-RoPE), which modules LoRA targets,
and how to write a tiny random-init checkpoint of the family for tests and CPU runs. The value and
action heads, the action tokens (the vocabulary's last n_bins ids) and everything after the
language model are the same for all.
"""

from __future__ import annotations

import torch


class Family:
    """The interface; the defaults fit a plain vision tower + projector + causal LM."""
    name = ""
    model_types: tuple = ()
    image_token = "<image>"
    special_tokens: tuple = ()      # what a tiny tokenizer of this family holds besides <pad> <s> </s> <unk>
    lora_targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
    prefix_bidirectional = False    # the prompt (image, instruction, state) attends to itself both ways

    # -- checkpoints
    def tiny_config(self, bcfg, image_size: int, tokenizer):
        """A random-init config of the family with policy.backbone's sizes."""
        raise NotImplementedError

    def image_processor(self, bcfg, image_size: int):
        """The family's image processor for a tiny checkpoint (saved as preprocessor_config.json)."""
        raise NotImplementedError

    # -- images
    def model_size(self, config, image_size: int) -> int:
        """The side of the square image the vision tower takes."""
        return int(config.vision_config.image_size)

    def image_seq_len(self, config, model_size: int) -> int:
        vc = config.vision_config
        return (model_size // vc.patch_size) ** 2

    def image_features(self, vlm, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def vision_dtype(self, vlm) -> torch.dtype:
        raise NotImplementedError

    # -- prompt and language model
    def markers(self, tokenizer) -> tuple[list, list]:
        """Token ids before and after the image tokens in the fixed part of the prompt."""
        raise NotImplementedError

    def decoder(self, vlm):
        return vlm.model.language_model

    def positions(self, attn: torch.Tensor, layout, config, model_size: int) -> torch.Tensor:
        """Position ids of the prompt [B, P] (a family with multi-axis positions: [A, B, P]);
        the tokens appended after it continue from the last one along the last axis."""
        return (attn.cumsum(1) - 1).clamp(min=0)


def need(ok: bool, msg: str) -> None:
    """A tiny config's size check: ValueError(msg) unless ok."""
    if not ok:
        raise ValueError(msg)


def known_ids(tokenizer, *tokens: str) -> list:
    """Ids of the tokens the tokenizer holds (a marker it lacks is left out)."""
    out = []
    for token in tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is not None and i != tokenizer.unk_token_id:
            out.append(i)
    return out


def _registry() -> dict:
    from . import idefics3, paligemma, qwen2_5_vl
    families = (idefics3.FAMILY, paligemma.FAMILY, qwen2_5_vl.FAMILY)
    return {t: f for f in families for t in f.model_types}


def supported_model_types() -> tuple:
    return tuple(_registry())


def family_by_name(name: str) -> Family:
    """The family named in policy.backbone.family (idefics3, paligemma, qwen2_5_vl)."""
    for f in set(_registry().values()):
        if f.name == name:
            return f
    raise ValueError(f"policy.backbone.family={name!r} is not allowed; choose one of {sorted(FAMILY_NAMES)}")


def family_of(config, where: str = "the backbone") -> Family:
    """The family of a loaded config (its model_type)."""
    return family_for_type(getattr(config, "model_type", None), where)


def family_for_type(model_type: str | None, where: str) -> Family:
    """The family of a config.json's model_type; an unknown one raises ValueError naming it and
    what is supported."""
    found = _registry().get(model_type)
    if found is None:
        raise ValueError(f"{where} holds a {model_type!r} model; supported: {', '.join(supported_model_types())}")
    return found


FAMILY_NAMES = ("idefics3", "paligemma", "qwen2_5_vl")
