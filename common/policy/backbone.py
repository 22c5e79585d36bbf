"""The VLM backbone: a tiny Idefics3 written offline, and loading of any compatible checkpoint.

The tiny backbone (SigLIP vision + Llama text, SmolVLM's architecture, random weights) is written
to a directory with `save_pretrained` like any Hugging Face checkpoint and then loaded through the
same `load_backbone` as a real SmolVLM / Idefics3, so the two paths cannot drift apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForImageTextToText, AutoTokenizer, Idefics3Config,
                          Idefics3ForConditionalGeneration, PreTrainedTokenizerFast)
from transformers.utils import logging as hf_logging

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<image>", "<fake_token_around_image>",
                  "<global-img>", "<end_of_utterance>")
IMAGE_TOKEN = "<image>"

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
def build_tiny_tokenizer(text_vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few sentences; ids 0..7 are the special tokens."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # The byte-level pre-tokenizer maps each byte to a printable stand-in character; ask it for them.
    alphabet = sorted({byte_level.pre_tokenize_str(chr(b))[0][0] for b in PRINTABLE_ASCII})
    min_size = len(SPECIAL_TOKENS) + len(alphabet)
    if text_vocab_size < min_size:
        raise ValueError(f"the tiny tokenizer needs at least {min_size} text ids (specials + printable "
                         f"bytes); policy.backbone.vocab_size - policy.n_bins leaves {text_vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=text_vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   extra_special_tokens=list(SPECIAL_TOKENS[4:]))


def tiny_backbone_config(bcfg, image_size: int, tokenizer) -> Idefics3Config:
    """Idefics3 config from `policy.backbone` (BackboneConfig); vision MLP width is 4x its hidden size."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ValueError(msg)
    need(bcfg.vision_hidden_size % bcfg.vision_heads == 0,
         f"policy.backbone.vision_hidden_size={bcfg.vision_hidden_size} must be divisible by "
         f"policy.backbone.vision_heads={bcfg.vision_heads}")
    need(bcfg.text_hidden_size % bcfg.text_heads == 0,
         f"policy.backbone.text_hidden_size={bcfg.text_hidden_size} must be divisible by "
         f"policy.backbone.text_heads={bcfg.text_heads}")
    need(bcfg.position_init != "sincos" or bcfg.vision_hidden_size % 4 == 0,
         f"policy.backbone.vision_hidden_size={bcfg.vision_hidden_size} must be a multiple of 4 for "
         "policy.backbone.position_init=sincos (sin and cos of rows and columns)")
    need(image_size % bcfg.patch_size == 0,
         f"policy.image_size={image_size} must be a multiple of policy.backbone.patch_size={bcfg.patch_size}")
    need((image_size // bcfg.patch_size) % bcfg.scale_factor == 0,
         f"patches per side ({image_size // bcfg.patch_size}) must be a multiple of "
         f"policy.backbone.scale_factor={bcfg.scale_factor}")
    ids = {name: tokenizer.convert_tokens_to_ids(t) for name, t in
           [("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"), ("image", IMAGE_TOKEN)]}
    return Idefics3Config(
        vision_config=dict(hidden_size=bcfg.vision_hidden_size, intermediate_size=4 * bcfg.vision_hidden_size,
                           num_hidden_layers=bcfg.vision_layers, num_attention_heads=bcfg.vision_heads,
                           image_size=image_size, patch_size=bcfg.patch_size),
        text_config=dict(model_type="llama", hidden_size=bcfg.text_hidden_size,
                         intermediate_size=bcfg.intermediate_size, num_hidden_layers=bcfg.text_layers,
                         num_attention_heads=bcfg.text_heads, num_key_value_heads=bcfg.text_heads,
                         vocab_size=bcfg.vocab_size, max_position_embeddings=4096,
                         pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                         tie_word_embeddings=False),
        image_token_id=ids["image"], scale_factor=bcfg.scale_factor, tie_word_embeddings=False,
        pad_token_id=ids["pad"])


def write_tiny_backbone(out_dir: str, bcfg, image_size: int, n_bins: int, seed: int = 0) -> str:
    """Build the tiny Idefics3 + tokenizer + image-processor config and save them as a checkpoint."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tiny_tokenizer(bcfg.vocab_size - n_bins)
    config = tiny_backbone_config(bcfg, image_size, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    if bcfg.position_init == "sincos":
        # A random-init tower from scratch learns where things are slowly: its position signal is
        # 10x weaker than a patch's content. A fixed 2-D pattern makes positions readable at once
        # (pixel task, BC: 33 % greedy success after 900 steps against 5 % with the random init).
        emb = model.model.vision_model.embeddings
        with torch.no_grad():
            emb.position_embedding.weight.copy_(sincos_positions(emb.num_patches_per_side, emb.embed_dim))
    processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                          max_image_size={"longest_edge": image_size})
    os.makedirs(out_dir, exist_ok=True)
    with quiet():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)
    return out_dir


def sincos_positions(side: int, dim: int) -> torch.Tensor:
    """[side*side, dim] 2-D sine-cosine position embeddings, row-major like the patches: a quarter
    of the channels each for sin/cos of the row and of the column, at geometric frequencies."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float64),
                                torch.arange(side, dtype=torch.float64), indexing="ij")

    def axis(coord):
        angle = coord.reshape(-1, 1) * omega
        return torch.cat([angle.sin(), angle.cos()], 1)
    return torch.cat([axis(rows), axis(cols)], 1).float()


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


def load_backbone(path: str, dtype: torch.dtype):
    """Load (model, tokenizer, ImageSpec) from a checkpoint directory onto the CPU in `dtype`."""
    check_backbone_dir(path)
    with quiet():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(path)
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("vision_model", "connector", "text_model")) \
            or not hasattr(model, "lm_head"):
        raise ValueError(f"checkpoint '{path}' holds a {type(model).__name__}; expected an Idefics3-style "
                         "VLM (vision_model + connector + text_model + lm_head, e.g. SmolVLM or Idefics3)")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_id != model.config.image_token_id:
        raise ValueError(f"checkpoint '{path}': the model's image_token_id={model.config.image_token_id} "
                         f"differs from the tokenizer's {IMAGE_TOKEN} id {image_id}")
    model.eval()
    return model, tokenizer, read_image_spec(path, model.config)


def read_image_spec(path: str, config) -> ImageSpec:
    """Image size from the vision config; rescale/mean/std from preprocessor_config.json when present."""
    spec = {"model_size": int(config.vision_config.image_size)}
    proc = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(proc):
        with open(proc) as f:
            p = json.load(f)
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
