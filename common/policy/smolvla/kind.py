"""SmolVLA as an asyncvla policy: the interface actors, learner, SFT and checkpoints use
(VLAPolicy's: act, evaluate, sft_loss, value, tokenize, the trainable tensors, save/load), on a
SmolVLA loaded from a LeRobot policy directory.

Acting for RL: the chunk is denoised as LeRobot denoises it (policy.py), as a chain with one Gaussian
step per sample (Flow-SDE, policy.flow.noise_level; flow_sampling.py), so that the learner can
score it again. The chain lives in SmolVLA's own space: chunk_size steps x max_action_dim entries,
normalised. Only the entries the env executes count in the log-prob: the first
policy.num_action_chunks steps of the first action_dim dimensions. The value head reads the VLM's
last hidden state of the state token, the prefix token that sees every other, and with
policy.value_encoder cnn the image through a small CNN of its own (value_head.py says why: the
expert reads every layer's keys and values, so the last hidden state may tell scenes apart
poorly, all the more with the VLM frozen).

What trains: the action expert, the state, action and time projections and the value head, and of
the VLM (`vlm_training`): nothing with policy.flow.train_expert_only (LeRobot's train_expert_only),
else LoRA adapters (policy.is_lora; `auto` targets the text model's q, k, v and o projections), else
every weight. Saved and exported tensors have LoRA merged into the weights it adapts, under
LeRobot's names, so LeRobot loads them as any SmolVLA.

A saved policy (`save_pretrained`) is a directory of its own:
    policy.json         asyncvla's record: "kind": "smolvla" and the run's policy settings
    lerobot/            the LeRobot directory with the current tensors (config.json, model.safetensors,
                        its processor files, unchanged), which LeRobot's SmolVLAPolicy loads
    vlm/                the VLM's config and tokenizer (lerobot/config.json names it "../vlm")
    heads.safetensors   the value head
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn

from ...config import PolicyConfig
from ...transport.protocol import Field
from ..action_tokenizer import ActionTokenizer
from ..flow import flow_matching_loss, interpolate, sample_time
from ..flow_sampling import FlowSampling, chain_logprob, sample_chain
from ..heads import ActionHead, SFTLoss
from ..heads.flow import check_chain
from ..lerobot_dir import normalized_state
from ..logprobs import reduce_logprobs
from ..model import (ActOutput, EvalOutput, _numpy, _policy_config_from_dict, load_trainable, lora_targets,
                     resolve_dtype)
from ..value_head import ValueHead
from .checkpoint import ACTION_KEY, CONFIG, WEIGHTS, LeRobotDirError, check_tensors, normalize, read_policy_dir
from .network import SmolVLANet
from .policy import SmolVLA, resize_with_pad

KIND = "smolvla"
VLM_PARAMS = "net.vlm_with_expert.vlm."
# What a run continuing a saved SmolVLA policy sets for itself (the rest is the saved policy's)
CONTINUED_SETTINGS = ("temperature", "precision", "flow", "is_lora", "lora_rank", "lora_alpha", "lora_dropout",
                      "lora_target_modules")
LEROBOT_DIR, VLM_DIR, HEADS_FILE, POLICY_FILE = "lerobot", "vlm", "heads.safetensors", "policy.json"
FORMAT, FORMAT_VERSION = "asyncvla-vla-policy", 1
VLM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt", "added_tokens.json", "preprocessor_config.json", "processor_config.json",
             "chat_template.json", "video_preprocessor_config.json", "generation_config.json")


def vlm_training(cfg: PolicyConfig) -> str:
    """How the VLM trains: "frozen" (policy.flow.train_expert_only), "lora" (policy.is_lora) or "full"."""
    return "frozen" if cfg.flow.train_expert_only else "lora" if cfg.is_lora else "full"


def settings_problems(spec, cfg: PolicyConfig) -> list[str]:
    """The run's policy settings (and so its env's) against a SmolVLA directory's, by name."""
    problems = []
    if len(spec.image_keys) != 1:
        problems.append(f"it reads {len(spec.image_keys)} cameras {list(spec.image_keys)}; the envs give one")
    if cfg.action_dim != spec.action_dim:
        problems.append(f"policy.action_dim={cfg.action_dim} but its action has {spec.action_dim} dimensions")
    if cfg.state_dim != spec.state_dim:
        problems.append(f"policy.state_dim={cfg.state_dim} but its observation.state has {spec.state_dim}")
    if cfg.num_action_chunks > spec.chunk_size:
        problems.append(f"policy.num_action_chunks={cfg.num_action_chunks} is above its chunk_size={spec.chunk_size}")
    if cfg.max_instruction_tokens > spec.tokenizer_max_length:
        problems.append(f"policy.max_instruction_tokens={cfg.max_instruction_tokens} is above its "
                        f"tokenizer_max_length={spec.tokenizer_max_length}")
    return problems


class SmolVLAChain(ActionHead):
    """What a segment carries to score a SmolVLA chunk again (the denoising chain and which of its
    steps was Gaussian); the policy itself acts and scores."""
    name = "smolvla_flow"
    densities = True
    sft_draws = True

    def __init__(self, cfg: PolicyConfig, num_steps: int, chunk_size: int, width: int):
        super().__init__(cfg)
        self.num_steps, self.chunk_size, self.width = num_steps, chunk_size, width

    def replay_fields(self) -> dict:
        n = self.num_steps
        return {"flow_chain": Field("float32", (n + 1, self.chunk_size, self.width), "step", "unit"),
                "flow_stochastic": Field("uint8", (n,), "step")}

    def check_replay(self, arrays):
        return check_chain(arrays)

    def freezes_backbone(self) -> bool:
        return True


class SmolVLAPolicy(nn.Module):
    STARTS_TRAINED = True       # a trained VLA: `asyncvla pipeline` goes straight to RL

    def __init__(self, vla: SmolVLA, cfg: PolicyConfig, vlm_dir: Path):
        super().__init__()
        self.cfg, self.spec, self.stats, self.tokenizer, self.vlm_dir = cfg, vla.spec, vla.dir.stats, vla.tokenizer, vlm_dir
        self.lerobot_config = vla.dir.config
        self.lerobot_path = vla.dir.path
        self.net = vla.net
        width = self.net.state_proj.out_features
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            self.value_head = ValueHead(width, cfg.value_head_hidden, cfg.value_encoder)
        self.head = SmolVLAChain(cfg, self.spec.num_steps, self.spec.chunk_size, self.spec.max_action_dim)
        # (asyncvla's segment checks read the instruction vocabulary from here; a SmolVLA has no
        # action tokens, so its 2 "bins" are never used)
        vocab = self.net.vlm_with_expert.text.get_input_embeddings().num_embeddings
        self.action_tokenizer = ActionTokenizer(n_bins=2, vocab_size=vocab)
        self._check(cfg)
        if vlm_training(cfg) == "lora":
            self._add_lora(cfg)
        self._set_trainable()

    def _add_lora(self, cfg: PolicyConfig) -> None:
        vlm = self.net.vlm_with_expert.vlm
        targets = lora_targets(cfg, vlm)
        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=targets)
        with torch.random.fork_rng(devices=[]):     # (every process building this config gets the same init)
            torch.manual_seed(cfg.init_seed + 1)
            try:
                inject_adapter_in_model(lora, vlm)
            except ValueError as e:
                raise ValueError(f"policy.lora_target_modules={targets!r} matches no module of the SmolVLA's "
                                 f"VLM ({e})") from None

    # ------------------------------------------------------------------------ construction
    @classmethod
    def build(cls, cfg: PolicyConfig, device="cpu", dtype: torch.dtype | None = None) -> "SmolVLAPolicy":
        """policy.pretrained_path: a LeRobot SmolVLA directory, or a SmolVLA policy saved by
        `save_pretrained` (SFT's, continued with this run's temperature, precision and noise)."""
        path = Path(cfg.pretrained_path)
        if not (path / POLICY_FILE).is_file():
            return cls.from_lerobot(path, cfg, device, dtype)
        saved = _policy_config_from_dict(json.loads((path / POLICY_FILE).read_text())["policy"])
        run = dataclasses.replace(saved, pretrained_path=str(path),
                                  **{k: getattr(cfg, k) for k in CONTINUED_SETTINGS})
        policy = cls._from_saved(path, run, device, dtype)
        policy._check(cfg)
        return policy

    @classmethod
    def from_lerobot(cls, path, cfg: PolicyConfig, device="cpu", dtype: torch.dtype | None = None) -> "SmolVLAPolicy":
        """A LeRobot SmolVLA directory, for a run whose policy settings are `cfg`."""
        dtype = dtype or resolve_dtype(cfg.precision, device)
        vla = SmolVLA.load(path, device=device, dtype=dtype)
        return cls(vla, cfg, vla.dir.vlm_dir).to(device).eval()

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype: torch.dtype | None = None) -> "SmolVLAPolicy":
        """A directory written by `save_pretrained`."""
        meta = json.loads((Path(path) / POLICY_FILE).read_text())
        return cls._from_saved(path, _policy_config_from_dict(meta["policy"]), device, dtype)

    @classmethod
    def _from_saved(cls, path, cfg: PolicyConfig, device, dtype) -> "SmolVLAPolicy":
        policy = cls.from_lerobot(Path(path) / LEROBOT_DIR, cfg, device, dtype)
        heads = load_file(str(Path(path) / HEADS_FILE))
        policy.value_head.load_state_dict({k.removeprefix("value_head."): v for k, v in heads.items()})
        return policy

    def _check(self, cfg: PolicyConfig) -> None:
        problems = settings_problems(self.spec, cfg)
        if problems:
            raise LeRobotDirError(f"policy.pretrained_path='{self.lerobot_path}': " + "; ".join(problems))

    @classmethod
    def preflight(cls, cfg: PolicyConfig) -> list[str]:
        """What keeps policy.pretrained_path from loading for this run, in lines, read before any
        process starts: the directory (type, settings, normaliser statistics, the VLM), its tensors'
        names and shapes against the network its config describes (built on the meta device), and
        the run's policy settings against it."""
        key = f"policy.pretrained_path={cfg.pretrained_path!r}"
        path = Path(cfg.pretrained_path)
        path = path / LEROBOT_DIR if (path / POLICY_FILE).is_file() else path
        try:
            d = read_policy_dir(path, weights=False)
            from transformers import AutoConfig
            with torch.device("meta"):
                net = SmolVLANet(AutoConfig.from_pretrained(d.vlm_dir), d.spec, 0, 0)
            check_tensors(net.state_dict(), d.weights, str(path / WEIGHTS))
        except (LeRobotDirError, OSError, ValueError) as e:
            return [f"{key}: {e}"]
        return [f"{key}: {p}" for p in settings_problems(d.spec, cfg)]

    # ------------------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.net.state_proj.weight.device

    @property
    def temperature(self) -> float:
        return self.cfg.temperature

    @property
    def sampling(self) -> FlowSampling:
        f = self.cfg.flow
        return FlowSampling(self.spec.num_steps, "flow_sde", f.noise_level, f.log_std_min, f.log_std_max)

    # ------------------------------------------------------------------------ entry points
    def tokenize(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """Each instruction + "\\n" (as LeRobot's processor), padded on the right to
        policy.max_instruction_tokens; too long raises ValueError."""
        if isinstance(texts, str):
            raise TypeError("tokenize expects a list of instructions, got a single str; wrap it in a list")
        n = self.cfg.max_instruction_tokens
        texts = [t if t.endswith("\n") else t + "\n" for t in texts]
        out = self.tokenizer(texts, padding="max_length", max_length=n, padding_side="right", return_tensors="np")
        if out["input_ids"].shape[1] > n:
            raise ValueError(f"an instruction has more than policy.max_instruction_tokens={n} tokens")
        return out["input_ids"].astype(np.int64), out["attention_mask"].astype(np.uint8)

    @torch.no_grad()
    def act(self, image, ids, mask, state=None, temperature: float | None = None, greedy: bool = False,
            generator: torch.Generator | None = None) -> ActOutput:
        """A chunk drawn as a chain (module docstring); greedy: LeRobot's own (ODE) denoising."""
        cache, pad, values = self._prefix(image, ids, mask, state)
        b, k, d = cache[0][0].shape[0], self.cfg.num_action_chunks, self.spec.action_dim
        out = sample_chain(self.net.velocity, self.sampling, cache, pad,
                           (b, self.spec.chunk_size, self.spec.max_action_dim), greedy, generator)
        actions = self._env_units(out.chain[:, -1, :k, :d])
        replay = {"flow_chain": out.chain, "flow_stochastic": out.stochastic.to(torch.uint8)}
        return ActOutput(_numpy(actions), {n: _numpy(v) for n, v in replay.items()},
                         _numpy(out.logp[:, :k, :d].reshape(b, k * d)), _numpy(values.float()))

    def evaluate(self, image, ids, mask, state, replay: dict, logprob_type: str = "token_level",
                 temperature: float | None = None, value_image=None) -> EvalOutput:
        cache, pad, values = self._prefix(image, ids, mask, state, value_image)
        b, k, d = cache[0][0].shape[0], self.cfg.num_action_chunks, self.spec.action_dim
        chain, stochastic = self._replay(replay, b)
        logp, entropy = chain_logprob(self.net.velocity, self.sampling, cache, pad, chain, stochastic)
        logp, entropy = (x[:, :k, :d].reshape(b, k * d) for x in (logp, entropy))
        return EvalOutput(reduce_logprobs(logp, logprob_type, k, d), reduce_logprobs(entropy, logprob_type, k, d),
                          values)

    def sft_loss(self, image, ids, mask, state, actions, generator: torch.Generator | None = None):
        """SmolVLA's flow-matching loss on demo chunks [B, K, D] (env units, normalised with the
        directory's statistics), over the K steps and D dimensions a demo has."""
        cache, pad, values = self._prefix(image, ids, mask, state)
        b, k, d = actions.shape
        target = torch.zeros(b, self.spec.chunk_size, self.spec.max_action_dim, device=self.device)
        target[:, :k, :d] = normalize(torch.as_tensor(actions, dtype=torch.float32, device=self.device),
                                      self.stats.get(ACTION_KEY, {}), self.spec.mode("ACTION"))
        dev = generator.device if generator is not None else self.device
        noise = torch.randn(target.shape, generator=generator, device=dev).to(self.device)
        t = sample_time((b,), generator, self.cfg.flow.time_alpha).to(self.device)
        x_t, _ = interpolate(target, noise, t)
        velocity = self.net.velocity(x_t, t, cache, pad)
        loss = flow_matching_loss(velocity[:, :k, :d], target[:, :k, :d], noise[:, :k, :d])
        return SFTLoss(loss.expand(b), values, {})

    def forward(self, image, ids, mask, state=None, *, replay: dict | None = None,
                logprob_type: str = "token_level", temperature: float | None = None, value_image=None,
                demo_actions=None, generator=None):
        if demo_actions is not None:
            return self.sft_loss(image, ids, mask, state, demo_actions, generator)
        return self.evaluate(image, ids, mask, state, replay, logprob_type, temperature, value_image)

    def value(self, image, ids, mask, state=None) -> torch.Tensor:
        return self._prefix(image, ids, mask, state)[2]

    # --------------------------------------------------------------- trainable parameters
    def _is_trainable(self, name: str) -> bool:
        if not name.startswith(VLM_PARAMS):
            return True
        return {"frozen": False, "lora": ".lora_" in name, "full": True}[vlm_training(self.cfg)]

    def _set_trainable(self):
        for name, p in self.named_parameters():
            p.requires_grad_(self._is_trainable(name))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters() if self._is_trainable(n)}

    def load_trainable_state_dict(self, state: dict) -> None:
        load_trainable(self, state)

    # ------------------------------------------------------------------------- save / load
    def save_lerobot(self, path, **config_changes) -> None:
        """A LeRobot SmolVLA directory with this policy's tensors: the source directory's config
        (with `config_changes`) and processor files, and a new model.safetensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for f in self.lerobot_path.iterdir():
            if f.is_file() and f.name not in (WEIGHTS, CONFIG) and not _same_file(f, path / f.name):
                shutil.copy2(f, path / f.name)
        weights = {f"model.{n}": t.detach().cpu().contiguous() for n, t in self._lerobot_tensors().items()}
        save_file(weights, str(path / WEIGHTS))
        config = dict(self.lerobot_config, **config_changes)
        (path / CONFIG).write_text(json.dumps(config, indent=4) + "\n")

    def _lerobot_tensors(self) -> dict[str, torch.Tensor]:
        """The network's tensors under LeRobot's names: LoRA's B A (times its scale) added to the
        weight it adapts, its own tensors left out."""
        state = {n.replace(".base_layer.", "."): t for n, t in self.net.state_dict().items() if ".lora_" not in n}
        with torch.no_grad():
            for name, module in self.net.named_modules():
                if isinstance(module, LoraLayer):
                    weight = module.get_base_layer().weight
                    state[f"{name}.weight"] = weight + module.get_delta_weight("default").to(weight.dtype)
        return state

    def export_lerobot(self, path) -> None:
        """A directory LeRobot's SmolVLAPolicy.from_pretrained and its processors load: the current
        tensors, the processor files, and the VLM's config and tokenizer in path/vlm, named by
        absolute path in config.json and in the tokenizer step (LeRobot looks for vlm_model_name
        from its working directory, or on the Hub). load_vlm_weights is false: model.safetensors
        holds the VLM's tensors too, so LeRobot builds the VLM from its config and loads them all
        from there (path/vlm holds no weights)."""
        path = Path(path)
        vlm = (path / VLM_DIR).resolve()
        self._copy_vlm(vlm)
        self.save_lerobot(path, vlm_model_name=str(vlm), load_vlm_weights=False)
        pre = path / "policy_preprocessor.json"
        if pre.is_file():
            pipeline = json.loads(pre.read_text())
            for step in pipeline.get("steps", []):
                if step.get("registry_name") == "tokenizer_processor":
                    step.setdefault("config", {})["tokenizer_name"] = str(vlm)
            pre.write_text(json.dumps(pipeline, indent=4) + "\n")

    def _copy_vlm(self, to: Path) -> None:
        to.mkdir(parents=True, exist_ok=True)
        for name in VLM_FILES:
            if (self.vlm_dir / name).is_file() and not _same_file(self.vlm_dir / name, to / name):
                shutil.copy2(self.vlm_dir / name, to / name)

    def save_pretrained(self, path) -> None:
        path = Path(path)
        self._copy_vlm(path / VLM_DIR)
        self.save_lerobot(path / LEROBOT_DIR, vlm_model_name=os.path.join("..", VLM_DIR))
        save_file({f"value_head.{n}": t.detach().cpu().contiguous() for n, t in self.value_head.state_dict().items()},
                  str(path / HEADS_FILE))
        policy = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k != "pretrained_path"}
        (path / POLICY_FILE).write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "kind": KIND,
                                                    "policy": policy}, indent=2))

    # ---------------------------------------------------------------------------- internals
    def _prefix(self, image, ids, mask, state, value_image=None):
        """(every layer's keys and values, the prefix padding mask, values [B] fp32). `value_image`:
        the critic's CNN reads it instead of `image` (algorithm.value_augment_shift's shifted one)."""
        pixels, ids, mask, state = self._inputs(image, ids, mask, state)
        present = torch.ones(pixels.shape[0], dtype=torch.bool, device=self.device)
        cache, pad, hidden = self.net.prefix([pixels], [present], ids, mask, state)
        critic_image = None
        if self.value_head.encoder is not None:
            critic_image = _tensor(image if value_image is None else value_image).to(self.device)
        return cache, pad, self.value_head(hidden.float(), critic_image)

    def _inputs(self, image, ids, mask, state):
        size = self.cfg.image_size
        image = _tensor(image)
        if image.dtype != torch.uint8 or image.ndim != 4 or tuple(image.shape[1:]) != (size, size, 3):
            raise ValueError(f"image must be uint8 [B, {size}, {size}, 3] (policy.image_size={size}); got "
                             f"{str(image.dtype).replace('torch.', '')} {list(image.shape)}")
        x = image.to(self.device).permute(0, 3, 1, 2).float() / 255.0
        if self.spec.resize_imgs_with_padding is not None:
            x = resize_with_pad(x, *self.spec.resize_imgs_with_padding)
        pixels = (x * 2.0 - 1.0).to(self.net.state_proj.weight.dtype)
        ids = _tensor(ids).to(self.device, torch.long)
        mask = _tensor(mask).to(self.device).bool()
        if self.spec.state_dim and state is None:
            raise ValueError(f"this policy reads a proprio state (policy.state_dim={self.spec.state_dim}); got none")
        if not self.spec.state_dim:
            state = torch.zeros(pixels.shape[0], 0)
        s = normalized_state(np.asarray(state) if not isinstance(state, torch.Tensor) else state, self.stats,
                             self.spec, self.device)
        return pixels, ids, mask, s.to(self.net.state_proj.weight.dtype)

    def _env_units(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x.float(), self.stats.get(ACTION_KEY, {}), self.spec.mode("ACTION"), inverse=True)

    def _replay(self, replay: dict, batch: int):
        n, c, w = self.spec.num_steps, self.spec.chunk_size, self.spec.max_action_dim
        chain, stochastic = replay.get("flow_chain"), replay.get("flow_stochastic")
        if chain is None or stochastic is None:
            raise ValueError("a SmolVLA policy evaluates chains: pass flow_chain and flow_stochastic (act's replay)")
        chain, stochastic = torch.as_tensor(chain), torch.as_tensor(stochastic)
        if tuple(chain.shape) != (batch, n + 1, c, w) or not chain.is_floating_point():
            raise ValueError(f"flow_chain must be float [B={batch}, {n + 1}, {c}, {w}]; got {list(chain.shape)}")
        if tuple(stochastic.shape) != (batch, n):
            raise ValueError(f"flow_stochastic must be [B={batch}, {n}]; got {list(stochastic.shape)}")
        return chain.to(self.device, torch.float32), stochastic.to(self.device).bool()


def _same_file(a: Path, b: Path) -> bool:
    return b.exists() and a.resolve() == b.resolve()


def _tensor(x) -> torch.Tensor:
    """A tensor as is; an array (or list) as a tensor sharing its memory where it can."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
