"""VLAPolicy: one model for the actors (sampling) and the learner (training).

The VLM (a family of families/: Idefics3 / SmolVLM, PaliGemma, Qwen2.5-VL) reads the image and the
instruction and predicts N = K*D action tokens; a value head reads the hidden state of the last prompt token.
With `policy.action_head=autoregressive`, `act` samples the action tokens one by one with the KV
cache (no grad) and `evaluate` teacher-forces given action tokens (with grad); with `parallel`
(action_head.py) both read all N tokens' distributions off one pass over the prompt and N learned
action queries. Both take their log-probs, entropies and values from one function, `_score` (a
pass turned into numbers by `token_logprobs`), at the same temperature (`policy.temperature`
unless overridden), so the learner's log-probs of the behaviour tokens reproduce the actor's
exactly for the same weights and inputs.

With `flow` (flow_expert.py, flow_sampling.py) the actions are continuous: one pass over the prompt
gives every layer's hidden states, an action expert denoises the chunk from them in
policy.flow.num_steps steps, and `act` returns the chain with its Gaussian steps, whose log-prob
`evaluate` recomputes from the same prompt pass.

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

from ..config import BackboneConfig, FlowConfig, PolicyConfig
from .action_head import ACTION_HEADS, ActionQueries, query_attention_mask
from .action_tokenizer import ActionTokenizer
from .backbone import (ImageSpec, base_state_dict, check_backbone_dir, load_backbone, quiet,
                       write_tiny_backbone)
from .families import family_of
from .flow import flow_matching_loss, interpolate, sample_time
from .flow_expert import FlowExpert
from .flow_sampling import FlowSampling, chain_logprob, sample_chain
from .logprobs import action_log_softmax, reduce_logprobs, token_logprobs
from .prompt import make_layout, tokenize_instructions
from .value_head import ImageTokens, StateEncoder, ValueHead

POLICY_FILE = "policy.json"
BACKBONE_DIR = "backbone"
ADAPTER_DIR = "adapter"
HEADS_FILE = "heads.safetensors"
# Parameters of the policy's own beside the VLM: trained with LoRA too, saved in HEADS_FILE.
HEAD_PREFIXES = ("value_head.", "state_encoder.", "action_queries.", "image_tokens.", "flow_expert.")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FORMAT = "asyncvla-vla-policy"
FORMAT_VERSION = 1
# Settings that shape the network or its inputs/outputs: a checkpoint used as policy.pretrained_path
# must agree with the config on these.
STRUCTURAL_KEYS = ("image_size", "action_dim", "num_action_chunks", "n_bins", "max_instruction_tokens",
                   "state_dim", "is_lora", "lora_rank", "value_encoder", "action_head", "cnn_image_tokens")
# The flow expert's shape (policy.flow.*): the rest of policy.flow may change between runs (noise_method
# too: a checkpoint gains or drops Flow-Noise's noise network as it loads).
FLOW_STRUCTURAL_KEYS = ("width", "depth", "heads", "kv_heads", "head_dim", "mlp", "train_expert_only")


class ActOutput(NamedTuple):
    actions: np.ndarray        # float32 [B, K, D], bin centres (flow: continuous) in [action_low, action_high]
    action_tokens: np.ndarray  # int64 [B, N] vocabulary ids (flow: [B, 0])
    logprobs: np.ndarray       # float32 [B, N] token level, under the sampling temperature (flow: per
                               # chunk entry, the mean over the chain's Gaussian steps)
    values: np.ndarray         # float32 [B]
    flow_chain: np.ndarray | None = None       # flow: float32 [B, S+1, K, D], noise ... the chunk in [-1, 1]
    flow_stochastic: np.ndarray | None = None  # flow: uint8 [B, S], 1 = that denoising step was Gaussian


class EvalOutput(NamedTuple):
    logprobs: torch.Tensor     # float32 [B, M], M = N, K or 1 (token / action / chunk level)
    entropy: torch.Tensor      # float32 [B, M], entropy over the action bins, summed like logprobs
    values: torch.Tensor       # float32 [B]
    mode_tokens: torch.Tensor  # int64 [B, N]: the most likely action-token id at each position (no grad)


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
        if cfg.action_head not in ACTION_HEADS:
            raise ValueError(f"policy.action_head={cfg.action_head!r} is not allowed; choose one of "
                             f"{list(ACTION_HEADS)}")
        # Built last, so that an autoregressive policy's init draws the same numbers as before.
        self.action_queries = (ActionQueries(self.num_action_tokens, hidden,
                                             getattr(vlm.config.text_config, "initializer_range", 0.02))
                               if cfg.action_head == "parallel" else None)
        self.image_tokens = ImageTokens(cfg.cnn_image_tokens, hidden) if cfg.cnn_image_tokens else None
        f = cfg.flow
        self.flow_expert = (FlowExpert(cfg.action_dim, cfg.num_action_chunks, hidden, f.width, f.depth, f.heads,
                                       f.kv_heads, f.head_dim, f.mlp, learn_noise=f.noise_method == "flow_noise")
                            if cfg.action_head == "flow" else None)
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
            policy.cfg = dataclasses.replace(policy.cfg, temperature=cfg.temperature, precision=cfg.precision,
                                             pretrained_path=path, flow=cfg.flow)
            if policy.flow_expert is not None:    # the noise method is RL's choice, not the checkpoint's
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(cfg.init_seed)
                    policy.flow_expert.set_learn_noise(cfg.flow.noise_method == "flow_noise")
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
            own = {n: p for n, p in policy.named_parameters() if n.startswith(HEAD_PREFIXES)}
            if set(heads) != set(own):
                raise ValueError(f"'{heads_file}' holds {sorted(heads)}; this policy's heads are "
                                 f"{sorted(own)}")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(heads[n])
        policy._set_trainable()
        return policy.to(torch.device(device)).eval()

    def _check_matches(self, cfg: PolicyConfig, path: str):
        pairs = [(key, getattr(cfg, key), getattr(self.cfg, key)) for key in STRUCTURAL_KEYS]
        if cfg.action_head == "flow" == self.cfg.action_head:
            pairs += [(f"flow.{k}", getattr(cfg.flow, k), getattr(self.cfg.flow, k)) for k in FLOW_STRUCTURAL_KEYS]
        for key, wanted, saved in pairs:
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

    @property
    def flow_sampling(self) -> FlowSampling:
        f = self.cfg.flow
        return FlowSampling(f.num_steps, f.noise_method, f.noise_level, f.log_std_min, f.log_std_max)

    # ------------------------------------------------------------------------ entry points
    def tokenize(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """list[str] -> ids int64 [B, L], mask uint8 [B, L] (left-padded); too long raises ValueError."""
        return tokenize_instructions(self.tokenizer, texts, self.cfg.max_instruction_tokens,
                                     self.layout.pad_id)

    @torch.no_grad()
    def act(self, image, ids, mask, state=None, temperature: float | None = None, greedy: bool = False,
            generator: torch.Generator | None = None) -> ActOutput:
        """Sample a chunk of actions (numpy outputs) from softmax(logits / T) over the action ids
        (T = policy.temperature unless given); greedy takes the argmax. Autoregressive head: tokens
        are drawn one by one with the KV cache, and the reported log-probs (under T, greedy too) and
        values then come from one teacher-forced pass over the sampled tokens: the computation
        `evaluate` does, so actor and learner agree to the last bit on the same inputs (the cached
        logits differ by rounding only). Parallel head: one pass gives every token's distribution;
        all are sampled and scored from it, and `evaluate` makes that same pass."""
        temperature = self.temperature if temperature is None else temperature
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        prompt = self._prompt(image, ids, mask, state)
        if self.flow_expert is not None:
            return self._act_flow(prompt, greedy, generator)
        if self.action_queries is not None:
            forward = self._query_pass(prompt)
            bins = self._choose(forward[0], temperature, greedy, generator)
        else:
            forward, bins = None, self._sample(prompt, temperature, greedy, generator)
        logp, _, values, _ = self._score(prompt, bins, temperature, forward)
        tokens = bins + self.action_tokenizer.first_id
        actions = self.action_tokenizer.from_bins(bins.cpu()).reshape(
            -1, self.cfg.num_action_chunks, self.cfg.action_dim)
        return ActOutput(actions.numpy(), tokens.cpu().numpy(), logp.cpu().numpy(), values.cpu().numpy())

    def evaluate(self, image, ids, mask, state, action_tokens, logprob_type: str = "token_level",
                 temperature: float | None = None, flow_chain=None, flow_stochastic=None,
                 value_image=None) -> EvalOutput:
        """Log-probs, entropies and values of given action tokens (with grad): teacher-forced with the
        autoregressive head; the one query pass with the parallel head (the tokens are not its input).
        Log-probs are under softmax(logits / T), T = policy.temperature unless given, as in `act`.
        Flow head: of the given chains instead (`act`'s flow_chain and flow_stochastic); the entropy
        is that of their Gaussian steps, and mode_tokens is empty [B, 0]. `value_image` (uint8 like
        `image`): what a value head that reads the image (value_encoder cnn) sees instead, e.g. a
        random shift of it; the policy's outputs are unchanged."""
        temperature = self.temperature if temperature is None else temperature
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        prompt = self._prompt(image, ids, mask, state)
        if value_image is not None:
            value_image = _as_tensor(value_image).to(image.device)
            if value_image.dtype != image.dtype or value_image.shape != image.shape:
                raise ValueError(f"value_image must be like the image, uint8 {list(image.shape)}; got "
                                 f"{str(value_image.dtype).replace('torch.', '')} {list(value_image.shape)}")
            prompt = (*prompt[:3], value_image)
        if self.flow_expert is not None:
            return self._evaluate_flow(prompt, flow_chain, flow_stochastic, logprob_type)
        bins = self._action_token_input(action_tokens, ids.shape[0]) - self.action_tokenizer.first_id
        logp, entropy, values, mode = self._score(prompt, bins, temperature)
        k, d = self.cfg.num_action_chunks, self.cfg.action_dim
        return EvalOutput(reduce_logprobs(logp, logprob_type, k, d),
                          reduce_logprobs(entropy, logprob_type, k, d), values,
                          mode + self.action_tokenizer.first_id)

    def forward(self, *args, flow_matching_actions=None, generator=None, **kwargs):
        """Same as `evaluate`, so a DeepSpeed engine wrapping this module can be called directly;
        with flow_matching_actions, `flow_matching_loss` of the observation args (flow SFT)."""
        if flow_matching_actions is not None:
            return self.flow_matching_loss(*args[:4], flow_matching_actions, generator)
        return self.evaluate(*args, **kwargs)

    def value(self, image, ids, mask, state=None) -> torch.Tensor:
        """V(x) [B] fp32 from the prompt alone (for bootstrapping truncated episodes)."""
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        embeds, attn, pos, image = self._prompt(image, ids, mask, state)
        hidden = self._decode(embeds, self._prompt_mask(attn, embeds.dtype), pos, cache=None,
                              use_cache=False).last_hidden_state
        return self.value_head(hidden[:, -1], image)

    # --------------------------------------------------------------- trainable parameters
    def _set_trainable(self):
        for name, p in self.named_parameters():
            p.requires_grad_(self._is_trainable(name))

    def _is_trainable(self, name: str) -> bool:
        if self.cfg.action_head == "flow" and self.cfg.flow.train_expert_only:
            return name.startswith(HEAD_PREFIXES)
        if not self.cfg.is_lora:
            return True
        return ".lora_" in name or name.startswith(HEAD_PREFIXES)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of what training changes (LoRA + heads, or every parameter without LoRA):
        what weight publishing ships."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if self._is_trainable(n)}

    def load_trainable_state_dict(self, state: dict) -> None:
        """Copy tensors (torch or numpy, any float dtype) from `trainable_state_dict()` of another copy."""
        own = {n: p for n, p in self.named_parameters() if self._is_trainable(n)}
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
                 if n.startswith(HEAD_PREFIXES)}
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

    def _action_token_input(self, action_tokens, batch: int) -> torch.Tensor:
        tokens = _as_tensor(action_tokens)
        n = self.num_action_tokens
        if tokens.ndim != 2 or tuple(tokens.shape) != (batch, n) or tokens.is_floating_point():
            raise ValueError(f"action_tokens must be integer [B={batch}, N={n}] "
                             f"(K={self.cfg.num_action_chunks} x D={self.cfg.action_dim}); got "
                             f"{str(tokens.dtype).replace('torch.', '')} {list(tokens.shape)}")
        first, vocab = self.action_tokenizer.first_id, self.action_tokenizer.vocab_size
        if int(tokens.min()) < first or int(tokens.max()) >= vocab:
            raise ValueError(f"action_tokens must be action-token ids in [{first}, {vocab}); got values in "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        return tokens.to(self.device, torch.long)

    def _sample(self, prompt, temperature: float, greedy: bool, generator) -> torch.Tensor:
        """Autoregressive decoding of the N action tokens with the KV cache -> bins int64 [B, N]."""
        embeds, attn, pos, _ = prompt
        out = self._decode(embeds, self._prompt_mask(attn, embeds.dtype), pos, cache=None, use_cache=True)
        bins = []
        for i in range(self.num_action_tokens):
            logits = self._action_logits(out.last_hidden_state[:, -1])  # [B, n_bins]
            bins.append(self._choose(logits, temperature, greedy, generator))
            if i + 1 < self.num_action_tokens:
                attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], 1)
                pos = pos[..., -1:] + 1
                embeds = self._embed(bins[-1][:, None] + self.action_tokenizer.first_id)
                out = self._decode(embeds, attn, pos, cache=out.past_key_values, use_cache=True)
        return torch.stack(bins, 1)

    def _score(self, prompt, bins: torch.Tensor, temperature: float, forward=None):
        """Log-probs of `bins` [B, N], entropies [B, N], values [B] and most likely bins [B, N] from
        the head's pass (`forward` = its (logits, values) when already made). The single place where
        act and evaluate get their numbers."""
        if forward is None:
            forward = self._query_pass(prompt) if self.action_queries is not None \
                else self._teacher_forced_pass(prompt, bins)
        logits, values = forward
        logp, entropy = token_logprobs(logits, bins, temperature)
        return logp, entropy, values, logits.detach().argmax(-1)

    def _teacher_forced_pass(self, prompt, bins: torch.Tensor):
        """Prompt + action tokens -> action logits [B, N, n_bins], values [B] (autoregressive head)."""
        embeds, attn, pos, image = prompt
        p, n = embeds.shape[1], self.num_action_tokens
        # The last action token predicts nothing we score, so it is not fed.
        embeds = torch.cat([embeds, self._embed(bins[:, :-1] + self.action_tokenizer.first_id)], 1)
        if self.family.prefix_bidirectional:
            attn = query_attention_mask(attn, n - 1, embeds.dtype, bidirectional_prompt=True, causal_queries=True)
        else:
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], n - 1)], 1)
        pos = torch.cat([pos, pos[..., -1:] + torch.arange(1, n, device=pos.device)], -1)
        hidden = self._decode(embeds, attn, pos, cache=None, use_cache=False).last_hidden_state
        return self._action_logits(hidden[:, p - 1:]), self.value_head(hidden[:, p - 1], image)

    def _query_pass(self, prompt):
        """Prompt + N action queries -> action logits [B, N, n_bins], values [B] (parallel head):
        the hidden state at query i predicts token i; the value reads the last prompt token, which
        does not see the queries."""
        embeds, attn, pos, image = prompt
        (b, p, _), n = embeds.shape, self.num_action_tokens
        embeds = torch.cat([embeds, self.action_queries(b, embeds.dtype)], 1)
        pos = torch.cat([pos, pos[..., -1:] + torch.arange(1, n + 1, device=pos.device)], -1)
        attn = query_attention_mask(attn, n, embeds.dtype, bidirectional_prompt=self.family.prefix_bidirectional)
        hidden = self._decode(embeds, attn, pos, cache=None, use_cache=False).last_hidden_state
        return self._action_logits(hidden[:, p:]), self.value_head(hidden[:, p - 1], image)

    # ------------------------------------------------------------------------ flow head
    def _prefix_pass(self, prompt):
        """The prompt alone -> the VLM's hidden states of every layer (embeddings first) and the
        value [B]: what the action expert reads, computed once per chunk."""
        embeds, attn, pos, image = prompt
        out = self._decode(embeds, self._prompt_mask(attn, embeds.dtype), pos, cache=None, use_cache=False,
                           output_hidden_states=True)
        return out.hidden_states, self.value_head(out.last_hidden_state[:, -1], image)

    def _act_flow(self, prompt, greedy: bool, generator) -> ActOutput:
        hidden_states, values = self._prefix_pass(prompt)
        kv = self.flow_expert.prefix_kv(hidden_states, len(hidden_states) - 1)
        b, k, d = prompt[0].shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        out = sample_chain(self.flow_expert, self.flow_sampling, kv, prompt[1], (b, k, d), greedy, generator)
        actions = self.action_tokenizer.from_unit(out.chain[:, -1].reshape(b, k * d)).reshape(b, k, d)
        return ActOutput(actions.cpu().numpy(), np.zeros((b, 0), np.int64),
                         out.logp.reshape(b, k * d).cpu().numpy(), values.float().cpu().numpy(),
                         out.chain.cpu().numpy(), out.stochastic.to(torch.uint8).cpu().numpy())

    def _evaluate_flow(self, prompt, chain, stochastic, logprob_type: str) -> EvalOutput:
        b, k, d = prompt[0].shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        chain, stochastic = self._flow_chain_input(chain, stochastic, b)
        hidden_states, values = self._prefix_pass(prompt)
        kv = self.flow_expert.prefix_kv(hidden_states, len(hidden_states) - 1)
        logp, entropy = chain_logprob(self.flow_expert, self.flow_sampling, kv, prompt[1], chain, stochastic)
        return EvalOutput(reduce_logprobs(logp.reshape(b, k * d), logprob_type, k, d),
                          reduce_logprobs(entropy.reshape(b, k * d), logprob_type, k, d), values,
                          torch.zeros(b, 0, dtype=torch.long, device=values.device))

    def flow_matching_loss(self, image, ids, mask, state, actions, generator=None):
        """SFT of the flow head (with grad): pi0's loss on demo actions [B, K, D] (env units, mapped
        to [-1, 1] with the policy's action range) at times from Beta(policy.flow.time_alpha, 1).
        Returns (loss, values [B])."""
        image, ids, mask, state = self._inputs(image, ids, mask, state)
        prompt = self._prompt(image, ids, mask, state)
        b, k, d = image.shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        target = self.action_tokenizer.to_unit(_as_tensor(actions).to(self.device, torch.float32).reshape(b, k * d))
        target = target.reshape(b, k, d)
        hidden_states, values = self._prefix_pass(prompt)
        kv = self.flow_expert.prefix_kv(hidden_states, len(hidden_states) - 1)
        dev = generator.device if generator is not None else self.device
        noise = torch.randn(target.shape, generator=generator, device=dev).to(self.device)
        t = sample_time((b,), generator, self.cfg.flow.time_alpha).to(self.device)
        x_t, _ = interpolate(target, noise, t)
        velocity = self.flow_expert(x_t.to(hidden_states[-1].dtype), t, kv, prompt[1])
        return flow_matching_loss(velocity, target, noise), values

    def _flow_chain_input(self, chain, stochastic, batch: int):
        n, k, d = self.cfg.flow.num_steps, self.cfg.num_action_chunks, self.cfg.action_dim
        if chain is None or stochastic is None:
            raise ValueError("a flow-head policy evaluates chains: pass flow_chain and flow_stochastic "
                             "(act's outputs), not action tokens")
        chain, stochastic = _as_tensor(chain), _as_tensor(stochastic)
        if tuple(chain.shape) != (batch, n + 1, k, d) or not chain.is_floating_point():
            raise ValueError(f"flow_chain must be float [B={batch}, S+1={n + 1}, K={k}, D={d}] "
                             f"(policy.flow.num_steps={n}); got {str(chain.dtype).replace('torch.', '')} "
                             f"{list(chain.shape)}")
        if tuple(stochastic.shape) != (batch, n):
            raise ValueError(f"flow_stochastic must be [B={batch}, S={n}]; got {list(stochastic.shape)}")
        if not torch.isfinite(chain).all():
            raise ValueError("flow_chain holds NaN or inf")
        return chain.to(self.device, torch.float32), stochastic.to(self.device).bool()

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

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._vlm.get_input_embeddings()(token_ids)

    def _prompt(self, image, ids, mask, state):
        """Prompt embeddings [B, P, H], attention mask [B, P], position ids [B, P] and the image
        (uint8 [B, H, W, 3], for a value head that reads it)."""
        lay, b = self.layout, ids.shape[0]
        fixed = torch.tensor(lay.fixed_ids, device=ids.device).expand(b, -1)
        embeds = self._embed(torch.cat([fixed, ids], 1))
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

    def _prompt_mask(self, attn, dtype):
        """The prompt's own mask: its padding mask [B, P], or for a family that attends to its prefix
        both ways the 4-D mask that says so."""
        if self.family.prefix_bidirectional:
            return query_attention_mask(attn, 0, dtype, bidirectional_prompt=True)
        return attn

    def _decode(self, embeds, attn, pos, cache, use_cache: bool, output_hidden_states: bool = False):
        return self.family.decoder(self._vlm)(inputs_embeds=embeds, attention_mask=attn, position_ids=pos,
                                              past_key_values=cache, use_cache=use_cache,
                                              output_hidden_states=output_hidden_states)

    def _action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the action ids only (the last n_bins of the vocabulary): [..., n_bins]."""
        return self._vlm.lm_head(hidden)[..., self.action_tokenizer.first_id:]

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, greedy: bool, generator) -> torch.Tensor:
        """Bins [...] from action logits [..., n_bins]."""
        if greedy:
            return logits.argmax(-1)
        probs = action_log_softmax(logits, temperature).exp()
        if generator is not None and generator.device != probs.device:
            probs = probs.to(generator.device)
        drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        return drawn.view(probs.shape[:-1]).to(logits.device)


# ------------------------------------------------------------------------------- helpers
def lora_targets(cfg: PolicyConfig, vlm) -> str:
    """policy.lora_target_modules, `auto` being the backbone family's."""
    return family_of(vlm.config).lora_targets if cfg.lora_target_modules == "auto" else cfg.lora_target_modules


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
    names = {f.name for f in dataclasses.fields(PolicyConfig)}
    bnames = {f.name for f in dataclasses.fields(BackboneConfig)}
    fnames = {f.name for f in dataclasses.fields(FlowConfig)}
    backbone = BackboneConfig(**{k: v for k, v in d.get("backbone", {}).items() if k in bnames})
    flow = FlowConfig(**{k: v for k, v in d.get("flow", {}).items() if k in fnames})
    return PolicyConfig(**{k: v for k, v in d.items() if k in names and k not in ("backbone", "flow")},
                        backbone=backbone, flow=flow)
