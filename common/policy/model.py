"""VLAPolicy: one model for the actors (sampling) and the learner (training).

A policy is a backbone (a VLM of one of families/: Idefics3 / SmolVLM, PaliGemma, Qwen2.5-VL), a
prompt (the image, the instruction and optionally the robot's state, prompt.py), a value head
(value_head.py: V(x) from the last prompt token's hidden state, and a small CNN of its own) and an
action head (heads/: autoregressive or parallel action tokens, a flow of continuous actions, or a
Gaussian). `act` samples a chunk and returns its replay, what scores it again; `evaluate` gives
the log-probs of a replay at a log-prob level, the entropies and values (with grad); `sft_loss`
the head's supervised loss on demo actions. Act and evaluate get their numbers from the same head
pass at the same temperature (`policy.temperature` unless overridden), so the learner's
log-probs of the behaviour actions reproduce the actor's exactly for the same weights and inputs.

The root module owns no parameters of its own (DeepSpeed ZeRO-3 gathers parameters with hooks on
submodules), and the VLM's submodules are always called, never their weights read, for the same reason.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import tempfile
from typing import NamedTuple

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import PolicyConfig, structural_keys
from .action_tokenizer import ActionTokenizer
from .backbone import (ImageSpec, base_state_dict, check_backbone_dir, load_backbone, quiet,
                       write_tiny_backbone)
from .families import family_of
from .heads import make_head
from .heads.queries import query_attention_mask
from .logprobs import reduce_logprobs
from .prompt import make_layout, tokenize_instructions
from .value_head import ImageTokens, StateEncoder, ValueHead

POLICY_FILE = "policy.json"
BACKBONE_DIR = "backbone"
ADAPTER_DIR = "adapter"
HEADS_FILE = "heads.safetensors"
# Parameters of the policy's own beside the VLM (these and its action head's modules): trained with
# LoRA too, saved in HEADS_FILE.
OWN_MODULES = ("value_head", "state_encoder", "image_tokens")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FORMAT = "asyncvla-vla-policy"
FORMAT_VERSION = 1


class ActOutput(NamedTuple):
    actions: np.ndarray        # float32 [B, K, D] in the env's units (token heads: bin centres)
    replay: dict               # name -> array [B, ...]: the head's replay of the actions (heads/)
    logprobs: np.ndarray       # float32 [B, N] per action entry, under the sampling temperature
    values: np.ndarray         # float32 [B]


class EvalOutput(NamedTuple):
    logprobs: torch.Tensor     # float32 [B, M], M = N, K or 1 (token / action / chunk level)
    entropy: torch.Tensor      # float32 [B, M], summed like logprobs
    values: torch.Tensor       # float32 [B]


def resolve_dtype(precision: str, device) -> torch.dtype:
    """auto = bf16 on a GPU, fp32 elsewhere."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    raise ValueError(f"policy.precision={precision!r} is not allowed; choose one of ['auto', 'fp32', 'bf16']")


class VLAPolicy(nn.Module):
    STARTS_TRAINED = False      # its heads are new: `asyncvla pipeline` runs demonstrations and SFT first

    def __init__(self, backbone: nn.Module, tokenizer, image_spec: ImageSpec, cfg: PolicyConfig):
        super().__init__()
        self.backbone = backbone  # the VLM, wrapped by peft when LoRA is on
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.image_spec = image_spec
        vlm = self._vlm
        self.family = family_of(vlm.config)
        hidden = vlm.config.text_config.hidden_size
        vocab = vlm.lm_head.out_features
        self.action_tokenizer = ActionTokenizer(n_bins=cfg.n_bins, vocab_size=vocab,
                                                low=tuple(cfg.action_low), high=tuple(cfg.action_high))
        self.value_head = ValueHead(hidden, cfg.value_head_hidden, cfg.value_encoder)
        self.state_encoder = StateEncoder(cfg.state_dim, hidden) if cfg.state_dim > 0 else None
        self.image_tokens = ImageTokens(cfg.cnn_image_tokens, hidden) if cfg.cnn_image_tokens else None
        # The action head's own modules, built last (the other modules' init draws what it did
        # before heads had modules), set on the policy under the head's names.
        self.head = make_head(cfg)
        modules = self.head.modules(hidden, getattr(vlm.config.text_config, "initializer_range", 0.02))
        for name, module in modules.items():
            self.add_module(name, module)
        self.own_prefixes = tuple(f"{n}." for n in (*OWN_MODULES, *modules))
        image_seq_len = self.family.image_seq_len(vlm.config, image_spec.model_size)
        self.layout = make_layout(tokenizer, vlm.config.image_token_id, image_seq_len,
                                  cfg.max_instruction_tokens, state_token=cfg.state_dim > 0,
                                  markers=self.family.markers(tokenizer))

    # ------------------------------------------------------------------------ construction
    @classmethod
    def build(cls, cfg: PolicyConfig, device="cpu", dtype: torch.dtype | None = None) -> "VLAPolicy":
        """The tiny backbone from cfg.backbone, or cfg.pretrained_path: a policy saved by
        `save_pretrained` (continued as it is) or a Hugging Face VLM (fresh LoRA and value head)."""
        path = cfg.pretrained_path
        dtype = dtype or resolve_dtype(cfg.precision, device)
        if path and os.path.isfile(os.path.join(path, POLICY_FILE)):
            policy = cls.from_pretrained(path, device=device, dtype=dtype)
            policy._check_matches(cfg, path)
            # The keys that shape nothing are this run's: temperature, precision, a head's free choices.
            policy.cfg = dataclasses.replace(policy.cfg, temperature=cfg.temperature, precision=cfg.precision,
                                             pretrained_path=path, flow=cfg.flow, gaussian=cfg.gaussian)
            policy.head.cfg = policy.cfg
            policy.head.adapt(policy, cfg)
            policy._set_trainable()
            return policy
        with (contextlib.nullcontext(path) if path else tempfile.TemporaryDirectory()) as src:
            if not path:  # written and then loaded like any checkpoint
                write_tiny_backbone(src, cfg.backbone, cfg.image_size, cfg.n_bins, seed=cfg.init_seed)
            vlm, tokenizer, image_spec = load_backbone(src, dtype, cfg.image_size)
        return cls._assemble(vlm, tokenizer, image_spec, cfg, device)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype | None = None) -> "VLAPolicy":
        """Load a directory written by `save_pretrained`.

        A missing piece raises FileNotFoundError naming the file."""
        meta = _read_policy_json(path)
        cfg = _policy_config_from_dict(meta["policy"])
        _require(path, HEADS_FILE)
        if cfg.is_lora:
            for name in ADAPTER_FILES:
                _require(path, os.path.join(ADAPTER_DIR, name))
        check_backbone_dir(os.path.join(path, BACKBONE_DIR))
        dtype = dtype or resolve_dtype(cfg.precision, device)
        vlm, tokenizer, _ = load_backbone(os.path.join(path, BACKBONE_DIR), dtype)
        image_spec = ImageSpec(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in meta["image"].items()})
        policy = cls._assemble(vlm, tokenizer, image_spec, cfg, device,
                               adapter_dir=os.path.join(path, ADAPTER_DIR),
                               heads_file=os.path.join(path, HEADS_FILE))
        if (policy.action_tokenizer.to_dict() != _as_lists(meta["action_tokens"], ("low", "high"))
                or policy.layout.to_dict() != meta["prompt"]):
            raise ValueError(f"policy checkpoint '{path}': the backbone's vocabulary or tokenizer does not "
                             f"match the action-token spec / prompt layout recorded in {POLICY_FILE}")
        return policy

    @classmethod
    def preflight(cls, cfg: PolicyConfig) -> list[str]:
        """What keeps policy.pretrained_path (a saved policy or a Hugging Face VLM) from loading, in
        lines (checked before any process starts)."""
        path, key = cfg.pretrained_path, f"policy.pretrained_path={cfg.pretrained_path!r}"
        if os.path.isfile(os.path.join(path, POLICY_FILE)):           # a policy saved by save_pretrained
            return []                                                 # (readable: kinds.kind_of read it)
        try:
            check_backbone_dir(path)
        except FileNotFoundError as e:
            return [f"{key}: {e} (expected a policy saved by asyncvla, a Hugging Face VLM directory or a "
                    "LeRobot SmolVLA directory)"]
        try:
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError) as e:
            return [f"{key}: config.json is not readable JSON ({e})"]
        from .families import supported_model_types
        if model_type not in supported_model_types():
            return [f"{key}: holds a {model_type!r} model; supported: {', '.join(supported_model_types())} "
                    "(common/policy/families/) or a policy saved by asyncvla"]
        return []

    @classmethod
    def _assemble(cls, vlm, tokenizer, image_spec, cfg, device, adapter_dir=None, heads_file=None):
        cfg = dataclasses.replace(cfg, backbone=dataclasses.replace(cfg.backbone))
        if vlm.lm_head.out_features <= cfg.n_bins:
            raise ValueError(f"policy.n_bins={cfg.n_bins} must be smaller than the vocabulary "
                             f"({vlm.lm_head.out_features} ids): action tokens are its last n_bins ids")
        # Seeded so that two processes building the same config get the same LoRA / heads init.
        with torch.random.fork_rng(devices=[]), quiet():
            torch.manual_seed(cfg.init_seed)
            if cfg.is_lora and adapter_dir is not None:
                backbone = PeftModel.from_pretrained(vlm, adapter_dir, is_trainable=True)
            elif cfg.is_lora:
                targets = lora_targets(cfg, vlm)
                lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                  target_modules=targets)
                try:
                    backbone = get_peft_model(vlm, lora)
                except ValueError as e:
                    raise ValueError(f"policy.lora_target_modules={targets!r} matches no "
                                     f"module of the backbone ({e})") from None
            else:
                backbone = vlm
            policy = cls(backbone, tokenizer, image_spec, cfg)
        if heads_file is not None:
            heads = load_file(heads_file)
            own = {n: p for n, p in policy.named_parameters() if n.startswith(policy.own_prefixes)}
            if set(heads) != set(own):
                raise ValueError(f"'{heads_file}' holds {sorted(heads)}; this policy's heads are "
                                 f"{sorted(own)}")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(heads[n])
        policy._set_trainable()
        return policy.to(torch.device(device)).eval()

    def _check_matches(self, cfg: PolicyConfig, path: str):
        """The policy a saved checkpoint holds must be the one `cfg` describes on every key that
        shapes it (the config's structural keys), but its backbone (the checkpoint's own) and its
        action range (the demos' of its SFT)."""
        for key in structural_keys(PolicyConfig, exclude=("backbone", "action_low", "action_high")):
            wanted, saved = _get(cfg, key), _get(self.cfg, key)
            if wanted != saved:
                raise ValueError(f"policy.{key}={wanted!r} but the checkpoint "
                                 f"policy.pretrained_path='{path}' was saved with {key}={saved!r}")

    # ------------------------------------------------------------------------- properties
    @property
    def _vlm(self):
        return self.backbone.get_base_model() if isinstance(self.backbone, PeftModel) else self.backbone

    @property
    def device(self) -> torch.device:
        return self.value_head.fc1.weight.device

    @property
    def temperature(self) -> float:
        return self.cfg.temperature

    @property
    def num_action_tokens(self) -> int:
        return self.cfg.num_action_chunks * self.cfg.action_dim

    # ------------------------------------------------------------------------ entry points
    def tokenize(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """list[str] -> ids int64 [B, L], mask uint8 [B, L] (left-padded); too long raises ValueError."""
        return tokenize_instructions(self.tokenizer, texts, self.cfg.max_instruction_tokens,
                                     self.layout.pad_id)

    @torch.no_grad()
    def act(self, image, ids, mask, state=None, temperature: float | None = None, greedy: bool = False,
            generator: torch.Generator | None = None) -> ActOutput:
        """Sample a chunk of actions (numpy outputs) from the head's distribution at temperature T
        (policy.temperature unless given; token heads: softmax(logits / T)); greedy takes its mode.
        The log-probs are per action entry under T, computed as `evaluate` computes them."""
        temperature = self.temperature if temperature is None else temperature
        prompt = self._prompt(*self._inputs(image, ids, mask, state))
        out = self.head.act(self, prompt, temperature, greedy, generator)
        return ActOutput(_numpy(out.actions), {k: _numpy(v) for k, v in out.replay.items()}, _numpy(out.logprobs),
                         _numpy(out.values.float()))

    def evaluate(self, image, ids, mask, state, replay: dict, logprob_type: str = "token_level",
                 temperature: float | None = None, value_image=None) -> EvalOutput:
        """Log-probs (summed to `logprob_type`), entropies and values of the actions `replay`
        describes (what `act` returned with them), with grad, at temperature T as in `act`.
        `value_image` (uint8 like `image`): what a value head that reads the image (value_encoder
        cnn) sees instead, e.g. a random shift of it; the policy's outputs are unchanged."""
        temperature = self.temperature if temperature is None else temperature
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        prompt = self._prompt(image, ids, mask, state)
        if value_image is not None:
            value_image = _as_tensor(value_image).to(image.device)
            if value_image.dtype != image.dtype or value_image.shape != image.shape:
                raise ValueError(f"value_image must be like the image, uint8 {list(image.shape)}; got "
                                 f"{str(value_image.dtype).replace('torch.', '')} {list(value_image.shape)}")
            prompt = (*prompt[:3], value_image)
        out = self.head.evaluate(self, prompt, replay, temperature)
        k, d = self.cfg.num_action_chunks, self.cfg.action_dim
        return EvalOutput(reduce_logprobs(out.logprobs, logprob_type, k, d),
                          reduce_logprobs(out.entropy, logprob_type, k, d), out.values)

    def sft_loss(self, image, ids, mask, state, actions, generator: torch.Generator | None = None):
        """The head's supervised loss on demo actions [B, K, D] (env units), with grad: (per-sample
        loss [B], values [B], per-sample stats {name: [B]})."""
        prompt = self._prompt(*self._inputs(image, ids, mask, state))
        return self.head.sft_loss(self, prompt, _as_tensor(actions), generator)

    def forward(self, image, ids, mask, state=None, *, replay: dict | None = None,
                logprob_type: str = "token_level", temperature: float | None = None, value_image=None,
                demo_actions=None, generator=None):
        """What a DeepSpeed engine wrapping this module calls: `evaluate` of `replay`, or with
        `demo_actions` the head's `sft_loss` of them."""
        if demo_actions is not None:
            return self.sft_loss(image, ids, mask, state, demo_actions, generator)
        return self.evaluate(image, ids, mask, state, replay, logprob_type, temperature, value_image)

    def value(self, image, ids, mask, state=None) -> torch.Tensor:
        """V(x) [B] fp32 from the prompt alone (for bootstrapping truncated episodes)."""
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        embeds, attn, pos, image = self._prompt(image, ids, mask, state)
        hidden = self.decode(embeds, self.prompt_mask(attn, embeds.dtype), pos, cache=None,
                             use_cache=False).last_hidden_state
        return self.value_head(hidden[:, -1], image)

    # --------------------------------------------------------------- trainable parameters
    def _set_trainable(self):
        for name, p in self.named_parameters():
            p.requires_grad_(self._is_trainable(name))

    def _is_trainable(self, name: str) -> bool:
        if self.head.freezes_backbone():
            return name.startswith(self.own_prefixes)
        if not self.cfg.is_lora:
            return True
        return ".lora_" in name or name.startswith(self.own_prefixes)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of what training changes (LoRA + heads, or every parameter without LoRA):
        what weight publishing ships."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if self._is_trainable(n)}

    def load_trainable_state_dict(self, state: dict) -> None:
        """Copy tensors (torch or numpy, any float dtype) from `trainable_state_dict()` of another copy."""
        load_trainable(self, state)

    # ------------------------------------------------------------------------- save / load
    def save_pretrained(self, path: str) -> None:
        """Write backbone/ (HF checkpoint + tokenizer), adapter/ (peft files, LoRA only),
        heads.safetensors and policy.json (action-token spec, prompt layout, image spec, settings)."""
        os.makedirs(path, exist_ok=True)
        vlm = self._vlm
        with quiet():
            vlm.save_pretrained(os.path.join(path, BACKBONE_DIR), state_dict=base_state_dict(vlm))
            self.tokenizer.save_pretrained(os.path.join(path, BACKBONE_DIR))
        if isinstance(self.backbone, PeftModel):
            # peft's own layout, written by hand: the base it belongs to is the backbone/ beside it
            # (not where it was first loaded from), and no model card.
            adapter_dir = os.path.join(path, ADAPTER_DIR)
            conf = copy.deepcopy(self.backbone.peft_config["default"])
            conf.base_model_name_or_path, conf.inference_mode = None, True
            conf.save_pretrained(adapter_dir)
            lora = get_peft_model_state_dict(self.backbone, save_embedding_layers=False)
            lora = {k: v.detach().cpu().contiguous() for k, v in lora.items()}
            save_file(lora, os.path.join(adapter_dir, ADAPTER_FILES[1]), metadata={"format": "pt"})
        heads = {n: p.detach().cpu().contiguous() for n, p in self.named_parameters()
                 if n.startswith(self.own_prefixes)}
        save_file(heads, os.path.join(path, HEADS_FILE))
        policy = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k != "pretrained_path"}
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "policy": policy,
                "action_tokens": self.action_tokenizer.to_dict(), "prompt": self.layout.to_dict(),
                "image": {k: list(v) if isinstance(v, tuple) else v
                          for k, v in dataclasses.asdict(self.image_spec).items()}}
        with open(os.path.join(path, POLICY_FILE), "w") as f:
            json.dump(meta, f, indent=2)

    # ---------------------------------------------------------------------------- internals
    def _inputs(self, image, ids, mask, state):
        """Validate the observation batch and move it to the policy's device."""
        size = self.cfg.image_size
        image = _as_tensor(image)
        if image.dtype != torch.uint8 or image.ndim != 4 or tuple(image.shape[1:]) != (size, size, 3):
            raise ValueError(f"image must be uint8 [B, {size}, {size}, 3] (policy.image_size={size}); got "
                             f"{str(image.dtype).replace('torch.', '')} {list(image.shape)}")
        b = image.shape[0]
        ids, mask = _as_tensor(ids), _as_tensor(mask)
        n_tok = self.cfg.max_instruction_tokens
        if ids.ndim != 2 or ids.shape[0] != b or ids.is_floating_point():
            raise ValueError(f"instruction ids must be integer [B={b}, {n_tok}]; got "
                             f"{str(ids.dtype).replace('torch.', '')} {list(ids.shape)}")
        if ids.shape[1] != n_tok:
            raise ValueError(f"instruction ids have {ids.shape[1]} tokens per row; the limit is "
                             f"policy.max_instruction_tokens={n_tok} (use policy.tokenize)")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"instruction mask must have the shape of the ids {list(ids.shape)}; "
                             f"got {list(mask.shape)}")
        if mask.numel() and not ((mask == 0) | (mask == 1)).all():
            raise ValueError("instruction mask must hold only 0 (padding) and 1 (token)")
        vocab = self.action_tokenizer.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"instruction ids must lie in [0, {vocab}); got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        s_dim = self.cfg.state_dim
        if s_dim > 0:
            if state is None:
                raise ValueError(f"this policy reads a proprio state (policy.state_dim={s_dim}); got none")
            state = _as_tensor(state)
            if tuple(state.shape) != (b, s_dim) or not state.is_floating_point():
                raise ValueError(f"state must be float [B={b}, {s_dim}]; got "
                                 f"{str(state.dtype).replace('torch.', '')} {list(state.shape)}")
            state = state.to(self.device, torch.float32)
        elif state is not None and _as_tensor(state).numel() > 0:
            raise ValueError(f"got a state of shape {list(_as_tensor(state).shape)} but policy.state_dim=0 "
                             "(set policy.state_dim to the env's state dim to use proprio)")
        else:
            state = None
        # Instruction columns that are padding in every row are dropped: short instructions padded to
        # policy.max_instruction_tokens made up ~30 % of the sequence, and a column masked in every row
        # changes nothing (positions count only tokens, and no one attends to it), up to rounding.
        used = mask.bool().any(0)
        used[-1] = True                                    # keep one column, even for empty instructions
        ids, mask = ids[:, used], mask[:, used]
        dev = self.device
        return image.to(dev), ids.to(dev, torch.long), mask.to(dev, torch.long), state

    def _pixels(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> normalised [B, 3, h, w] as the checkpoint's image processor would."""
        spec = self.image_spec
        x = image.permute(0, 3, 1, 2).float() * spec.rescale
        if x.shape[-1] != spec.model_size:
            # Bicubic with antialiasing, clamped like 8-bit pixels, is the closest torch op to the
            # processors' Lanczos resize.
            x = torch.nn.functional.interpolate(x, size=(spec.model_size, spec.model_size), mode="bicubic",
                                                antialias=True, align_corners=False)
            x = x.clamp(0, 255 * spec.rescale)
        mean = torch.tensor(spec.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, device=x.device).view(1, 3, 1, 1)
        return ((x - mean) / std).to(self.family.vision_dtype(self._vlm))

    # What the heads reach the VLM through (heads/): always by calling its submodules.
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._vlm.get_input_embeddings()(token_ids)

    def _prompt(self, image, ids, mask, state):
        """Prompt embeddings [B, P, H], attention mask [B, P], position ids [B, P] and the image
        (uint8 [B, H, W, 3], for a value head that reads it)."""
        lay, b = self.layout, ids.shape[0]
        fixed = torch.tensor(lay.fixed_ids, device=ids.device).expand(b, -1)
        embeds = self.embed(torch.cat([fixed, ids], 1))
        feats = self.family.image_features(self._vlm, self._pixels(image))
        s, n = lay.image_start, lay.image_seq_len
        parts = [embeds[:, :s], feats.to(embeds.dtype), embeds[:, s + n:]]
        attn = [mask.new_ones(b, fixed.shape[1]), mask]
        if self.state_encoder is not None:
            parts.append(self.state_encoder(state, embeds.dtype))
            attn.append(mask.new_ones(b, 1))
        if self.image_tokens is not None:
            parts.append(self.image_tokens(image, embeds.dtype))
            attn.append(mask.new_ones(b, self.cfg.cnn_image_tokens))
        attn = torch.cat(attn, 1)
        pos = self.family.positions(attn, lay, self._vlm.config, self.image_spec.model_size)
        return torch.cat(parts, 1), attn, pos, image

    def prompt_mask(self, attn, dtype):
        """The prompt's own mask: its padding mask [B, P], or for a family that attends to its prefix
        both ways the 4-D mask that says so."""
        if self.family.prefix_bidirectional:
            return query_attention_mask(attn, 0, dtype, bidirectional_prompt=True)
        return attn

    def decode(self, embeds, attn, pos, cache, use_cache: bool, output_hidden_states: bool = False):
        return self.family.decoder(self._vlm)(inputs_embeds=embeds, attention_mask=attn, position_ids=pos,
                                              past_key_values=cache, use_cache=use_cache,
                                              output_hidden_states=output_hidden_states)

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the action ids only (the last n_bins of the vocabulary): [..., n_bins]."""
        return self._vlm.lm_head(hidden)[..., self.action_tokenizer.first_id:]


# ------------------------------------------------------------------------------- helpers
def load_trainable(policy: nn.Module, state: dict) -> None:
    """Copy `state` (torch or numpy, any float dtype) into the policy's trainable parameters (its
    `_is_trainable` names), checking that the names and shapes are exactly those."""
    own = {n: p for n, p in policy.named_parameters() if policy._is_trainable(n)}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise KeyError(f"trainable state dict does not match this policy: {len(missing)} missing "
                       f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    with torch.no_grad():
        for name, p in own.items():
            value = torch.as_tensor(state[name])
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"trainable tensor '{name}': expected shape {tuple(p.shape)}, "
                                 f"got {tuple(value.shape)}")
            p.copy_(value.to(device=p.device, dtype=p.dtype))


def lora_targets(cfg: PolicyConfig, vlm) -> str:
    """policy.lora_target_modules, `auto` being the backbone family's."""
    return family_of(vlm.config).lora_targets if cfg.lora_target_modules == "auto" else cfg.lora_target_modules


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def _require(path: str, rel: str) -> None:
    if not os.path.isfile(os.path.join(path, rel)):
        raise FileNotFoundError(f"policy checkpoint '{path}' is missing '{rel}' (written by "
                                "VLAPolicy.save_pretrained)")


def _read_policy_json(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"policy checkpoint directory '{path}' does not exist")
    _require(path, POLICY_FILE)
    with open(os.path.join(path, POLICY_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"'{os.path.join(path, POLICY_FILE)}' has format {meta.get('format')!r} version "
                         f"{meta.get('format_version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    return meta


def _as_lists(d: dict, keys) -> dict:
    """Policies saved before per-dimension action ranges wrote low/high as one number."""
    return {k: ([v] if k in keys and not isinstance(v, list) else v) for k, v in d.items()}


def _policy_config_from_dict(d: dict) -> PolicyConfig:
    """policy.json's settings as a PolicyConfig: keys it lacks (an older version wrote it) take their
    defaults, keys this version no longer has are left out."""
    def build(cls, values: dict):
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            section = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
            kwargs[f.name] = build(section, values[f.name] or {}) if section else values[f.name]
        return cls(**kwargs)
    return build(PolicyConfig, d)


def _get(cfg, dotted: str):
    """cfg's value of a dotted key ('flow.width')."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
