"""The VLM backbone: a tiny one of any supported family written offline, and loading of checkpoints.

The tiny backbone (random weights, policy.backbone's sizes, SmolVLM's architecture by default:
policy.backbone.family picks idefics3, paligemma or qwen2_5_vl) is written to a directory with
`save_pretrained` like any Hugging Face checkpoint and then loaded through the same
`load_backbone` as a real one, so the two paths cannot drift apart. What differs between the
families is in families/.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForImageTextToText, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from .families import Family, family_by_name, family_for_type, need
from .families.idefics3 import FAMILY as IDEFICS3
from .positions import sincos_positions

BASE_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
SPECIAL_TOKENS = BASE_TOKENS + IDEFICS3.special_tokens

# The tiny tokenizer learns its merges from robot instructions; any printable-ASCII text still
# tokenizes (the alphabet holds every printable byte), other bytes become <unk>.
TOKENIZER_CORPUS = (
    "push the cube to the goal region",
    "pick up the red cube and move it to the goal position",
    "pull the cube towards the robot base",
    "lift the peg and stand it upright",
    "stack the red cube on top of the green cube",
    "move the gripper to the target and reach the red dot",
    "open the drawer, close the door, turn the handle",
    "put the object on the plate and place the block in the box",
)
PRINTABLE_ASCII = range(32, 127)


@dataclass(frozen=True)
class ImageSpec:
    """How the checkpoint's image processor prepares pixels: vision-tower input size, rescale, mean, std."""
    model_size: int
    rescale: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)


# ---------------------------------------------------------------------------- tiny backbone
def build_tiny_tokenizer(text_vocab_size: int, family: Family = IDEFICS3) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few sentences; the first ids are <pad> <s> </s> <unk> and the
    family's special tokens."""
    specials = BASE_TOKENS + family.special_tokens
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # The byte-level pre-tokenizer maps each byte to a printable stand-in character; ask it for them.
    alphabet = sorted({byte_level.pre_tokenize_str(chr(b))[0][0] for b in PRINTABLE_ASCII})
    min_size = len(specials) + len(alphabet)
    if text_vocab_size < min_size:
        raise ValueError(f"the tiny tokenizer needs at least {min_size} text ids (specials + printable "
                         f"bytes); policy.backbone.vocab_size - policy.n_bins leaves {text_vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=text_vocab_size, special_tokens=list(specials),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   extra_special_tokens=list(family.special_tokens))


def tiny_backbone_config(bcfg, image_size: int, tokenizer, family: Family = IDEFICS3):
    """The family's random-init config of `policy.backbone`'s sizes (BackboneConfig); the vision
    MLP is 4x the vision width."""
    need(bcfg.vision_hidden_size % bcfg.vision_heads == 0,
         f"policy.backbone.vision_hidden_size={bcfg.vision_hidden_size} must be divisible by "
         f"policy.backbone.vision_heads={bcfg.vision_heads}")
    need(bcfg.text_hidden_size % bcfg.text_heads == 0,
         f"policy.backbone.text_hidden_size={bcfg.text_hidden_size} must be divisible by "
         f"policy.backbone.text_heads={bcfg.text_heads}")
    need(bcfg.position_init != "sincos" or bcfg.vision_hidden_size % 4 == 0,
         f"policy.backbone.vision_hidden_size={bcfg.vision_hidden_size} must be a multiple of 4 for "
         "policy.backbone.position_init=sincos (sin and cos of rows and columns)")
    return family.tiny_config(bcfg, image_size, tokenizer)


def write_tiny_backbone(out_dir: str, bcfg, image_size: int, n_bins: int, seed: int = 0) -> str:
    """Build a tiny model of policy.backbone.family + tokenizer + image-processor config and save
    them as a checkpoint."""
    family = family_by_name(bcfg.family)
    tokenizer = build_tiny_tokenizer(bcfg.vocab_size - n_bins, family)
    config = tiny_backbone_config(bcfg, image_size, tokenizer, family)
    with torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    emb = family.position_embedding(model)
    if bcfg.position_init == "sincos" and emb is not None:
        # A random-init tower from scratch learns where things are slowly: its position signal is
        # 10x weaker than a patch's content. A fixed 2-D pattern makes positions readable at once
        # (pixel task, BC: 33 % greedy success after 900 steps against 5 % with the random init).
        weight = emb.position_embedding.weight                  # [patches, width], patches row-major
        with torch.no_grad():
            weight.copy_(sincos_positions(round(weight.shape[0] ** 0.5), weight.shape[1]))
    processor = family.image_processor(bcfg, image_size)
    os.makedirs(out_dir, exist_ok=True)
    with quiet():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------------- loading
# safetensors only: a pickled pytorch_model.bin runs code when loaded, and actors load the backbone
# a learner sends them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_backbone_dir(path: str) -> None:
    """Raise FileNotFoundError naming the first missing piece of a Hugging Face checkpoint."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"backbone checkpoint directory '{path}' does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"backbone checkpoint '{path}' is missing 'config.json'")
    for what, names in (("weights", WEIGHT_FILES), ("tokenizer", TOKENIZER_FILES)):
        if not any(os.path.isfile(os.path.join(path, n)) for n in names):
            raise FileNotFoundError(f"backbone checkpoint '{path}' is missing its {what}: expected one of "
                                    f"{', '.join(repr(n) for n in names)}")


def checkpoint_family(path: str) -> Family:
    """The family of the checkpoint at `path` (its config.json's model_type); unknown ones raise
    ValueError naming what was found and what is supported."""
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    return family_for_type(model_type, f"checkpoint '{path}'")


def load_backbone(path: str, dtype: torch.dtype, image_size: int | None = None):
    """Load (model, tokenizer, ImageSpec) from a checkpoint directory onto the CPU in `dtype`;
    `image_size` (policy.image_size) fixes the side of a family with dynamic resolution."""
    check_backbone_dir(path)
    family = checkpoint_family(path)
    with quiet():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(path)
    if not hasattr(model, "lm_head"):
        raise ValueError(f"checkpoint '{path}' holds a {type(model).__name__} without an lm_head")
    image_id = tokenizer.convert_tokens_to_ids(family.image_token)
    if image_id != model.config.image_token_id:
        raise ValueError(f"checkpoint '{path}': the model's image_token_id={model.config.image_token_id} "
                         f"differs from the tokenizer's {family.image_token} id {image_id}")
    model.eval()
    return model, tokenizer, read_image_spec(path, model.config, family, image_size)


def read_image_spec(path: str, config, family: Family = IDEFICS3, image_size: int | None = None) -> ImageSpec:
    """The vision tower's image side (the family's rule); rescale/mean/std from
    preprocessor_config.json when present."""
    p = {}
    proc = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(proc):
        with open(proc) as f:
            p = json.load(f)
    size = image_size if image_size is not None else int(getattr(config.vision_config, "image_size", 0) or 224)
    spec = {"model_size": family.model_size(config, size)}
    if p:
        for key, name in (("rescale", "rescale_factor"), ("mean", "image_mean"), ("std", "image_std")):
            if p.get(name) is not None:
                spec[key] = tuple(p[name]) if isinstance(p[name], list) else float(p[name])
    return ImageSpec(**spec)


def base_state_dict(model: torch.nn.Module) -> dict:
    """The backbone's own weights with any injected LoRA layers stripped (peft names undone)."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}


@contextlib.contextmanager
def quiet():
    """Hide transformers' progress bars and a deprecation warning peft triggers (restored afterwards)."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
