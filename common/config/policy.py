"""policy: the VLA's backbone, action head and critic, and the checks across their keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .fields import opt


@dataclass
class BackboneConfig:
    """A tiny random-init VLM of one family (by default Idefics3/SmolVLM: SigLIP vision + Llama
    text), used when no pretrained_path is set."""
    family: str = opt("idefics3", "architecture of the tiny backbone: idefics3 (SmolVLM's), paligemma (pi0's) "
                      "or qwen2_5_vl", choices=["idefics3", "paligemma", "qwen2_5_vl"], structural=True)
    vision_hidden_size: int = opt(192, "vision tower width", ge=8, structural=True)
    vision_layers: int = opt(4, "vision tower depth", ge=1, structural=True)
    vision_heads: int = opt(4, "vision attention heads", ge=1, structural=True)
    patch_size: int = opt(8, "vision patch size in pixels", ge=1, structural=True)
    text_hidden_size: int = opt(256, "language model width", ge=8, structural=True)
    text_layers: int = opt(6, "language model depth", ge=1, structural=True)
    text_heads: int = opt(4, "language model attention heads", ge=1, structural=True)
    intermediate_size: int = opt(512, "MLP width of the language model", ge=8, structural=True)
    vocab_size: int = opt(512, "vocabulary size of the built tokenizer (the last n_bins ids are "
                          "action tokens)", ge=64, structural=True)
    scale_factor: int = opt(2, "pixel-shuffle factor between vision tower and language model", ge=1, structural=True)
    position_init: str = opt("sincos", "init of the vision tower's patch-position embeddings: sincos "
                             "(fixed 2-D sine-cosine pattern, as MAE; positions are readable from the "
                             "start) or random (normal, std 0.02: 10x weaker than a patch's content)",
                             choices=["sincos", "random"], structural=True)


@dataclass
class FlowConfig:
    """The flow head (policy.action_head=flow): an action expert denoising the K x D chunk
    (common/policy/flow_expert.py) and how its chain is sampled (common/policy/flow_sampling.py)."""
    width: int = opt(64, "the action expert's width", ge=8, structural=True)
    depth: int = opt(2, "the action expert's layers; layer l reads the VLM's matching layer", ge=1, structural=True)
    heads: int = opt(4, "query heads of the expert's attention", ge=1, structural=True)
    kv_heads: int = opt(1, "key/value heads (heads must be a multiple of it)", ge=1, structural=True)
    head_dim: int = opt(16, "size of one attention head", ge=4, structural=True)
    mlp: int = opt(128, "hidden width of the expert's gated MLP", ge=8, structural=True)
    num_steps: int = opt(4, "denoising (Euler) steps per chunk, from noise at t = 1 to the actions at t = 0", ge=1)
    noise_method: str = opt("flow_noise", "which steps are Gaussian, for log-probs: flow_noise (every "
                            "step, with a learned std; reached 95 % sooner in the heads benchmark) or "
                            "flow_sde (one random step per chunk, its std from noise_level)",
                            choices=["flow_noise", "flow_sde"])
    noise_level: float = opt(0.5, "Flow-SDE's a in sigma_t = a sqrt(t / (1 - t))", gt=0.0)
    log_std_min: float = opt(-5.0, "Flow-Noise: lower end of the learned log-std")
    log_std_max: float = opt(-1.0, "Flow-Noise: upper end of the learned log-std")
    time_alpha: float = opt(1.5, "SFT draws the denoising time from Beta(time_alpha, 1) (pi0: 1.5)", gt=0.0)
    train_expert_only: bool = opt(False, "train only the action expert and the value head, the VLM frozen "
                                  "(pi0's expert-only fine-tuning); else as policy.is_lora says", structural=True)


@dataclass
class GaussianConfig:
    """The Gaussian head (policy.action_head=gaussian): a diagonal Gaussian over the continuous K x D
    chunk in the unit action space (common/policy/heads/gaussian.py), its mean from the action
    queries, its log-std learned per entry and independent of the state."""
    log_std_init: float = opt(-1.0, "the log-std a new policy starts from (the unit action space: [-1, 1] "
                              "is the policy's action range)")
    log_std_min: float = opt(-5.0, "lower end of the learned log-std")
    log_std_max: float = opt(0.0, "upper end of the learned log-std")


@dataclass
class PolicyConfig:
    pretrained_path: Optional[str] = opt(None, "a checkpoint directory loadable with from_pretrained "
                                         "(a VLA saved by this project or a compatible VLM); null builds "
                                         "the tiny backbone below")
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    image_size: int = opt(64, "square image side the policy sees; envs resize to it", ge=16, le=1024, structural=True)
    action_dim: int = opt(7, "action dimensions D per env step (must match the env)", ge=1, structural=True)
    num_action_chunks: int = opt(4, "env steps K per policy action (action chunk)", ge=1, structural=True)
    n_bins: int = opt(256, "uniform bins over [action_low, action_high] per action dimension", ge=2, structural=True)
    action_head: str = opt("autoregressive", "how the N = K*D actions are predicted: autoregressive "
                           "(one action token per forward pass, each fed back), parallel (all tokens at "
                           "once from N learned action queries after the prompt, as OpenVLA-OFT) or flow "
                           "(continuous actions denoised by an action expert reading the prompt, as pi0; "
                           "policy.flow) or gaussian (a diagonal Gaussian over the continuous chunk, its "
                           "mean from action queries, as ManiSkill's PPO; policy.gaussian)",
                           choices=["autoregressive", "parallel", "flow", "gaussian"], structural=True)
    action_low: List[float] = opt([-1.0], "lower end of the binned action range, per dimension (one "
                                  "value: every dimension); `asyncvla sft` with sft.action_range=q99 "
                                  "sets it from the demos, and a saved policy keeps its own", structural=True)
    action_high: List[float] = opt([1.0], "upper end of the binned action range (see action_low)", structural=True)
    max_instruction_tokens: int = opt(32, "instructions are padded/limited to this many tokens", ge=1, structural=True)
    is_lora: bool = opt(True, "train LoRA adapters (+ value head) instead of every weight", structural=True)
    lora_rank: int = opt(32, "LoRA rank", ge=1, structural=True)
    lora_alpha: int = opt(32, "LoRA alpha (scale = alpha / rank)", ge=1)
    lora_dropout: float = opt(0.0, "LoRA dropout", ge=0.0, lt=1.0)
    lora_target_modules: str = opt("auto", "regex of module names that get LoRA adapters; auto: the "
                                   "backbone family's language-model attention projections (q, k, v, o)", structural=True)
    value_head_hidden: int = opt(256, "hidden width of the value-head MLP", ge=1, structural=True)
    value_encoder: str = opt("none", "what the value head reads besides the VLM's last prompt token: "
                             "none, or cnn (a small CNN of its own on the image; a VLM with no robot "
                             "pretraining barely tells scenes apart, and its critic then learns nothing)",
                             choices=["none", "cnn"], structural=True)
    cnn_image_tokens: int = opt(0, "prompt tokens from a small CNN of the policy's own on the image, "
                                "a g x g grid of its feature map after the state token (0 = none): a "
                                "random-init ViT learns where a small object is far more slowly than "
                                "a CNN", choices=[0, 1, 4, 16, 64], structural=True)
    state_dim: int = opt(0, "proprio dims S the policy reads as one extra prompt token (0 = none; "
                         "must equal the env's state_dim when env.use_proprio)", ge=0, structural=True)
    init_seed: int = opt(0, "seed of the tiny backbone's random init and of the LoRA / value-head init "
                         "(same seed, same weights)", ge=0)
    precision: str = opt("auto", "auto = bf16 on GPU, fp32 on CPU", choices=["auto", "fp32", "bf16"])
    temperature: float = opt(1.0, "temperature of the action-token distribution softmax(logits/T): "
                             "actors sample from it and the learner evaluates log-probs under it", gt=0.0)
    flow: FlowConfig = field(default_factory=FlowConfig)
    gaussian: GaussianConfig = field(default_factory=GaussianConfig)


# Text ids the built tiny tokenizer needs: <pad> <s> </s> <unk>, a family's special tokens (at most 4)
# and the 95 printable bytes (common/policy/backbone.build_tiny_tokenizer; a test keeps them in step).
TINY_TEXT_IDS_MIN = 103


def check_action_range(p: "PolicyConfig") -> list[str]:
    low, high = list(p.action_low), list(p.action_high)
    for key, v in (("action_low", low), ("action_high", high)):
        if len(v) not in (1, p.action_dim):
            return [f"policy.{key}={v} must have 1 value or policy.action_dim={p.action_dim} values"]
        if not all(-1.0 <= x <= 1.0 for x in v):
            return [f"policy.{key}={v} must lie in the env's action range [-1, 1]"]
    if len(low) != len(high) or not all(lo < hi for lo, hi in zip(low, high)):
        return [f"policy.action_low={low} and policy.action_high={high} must have the same length and "
                "low < high in every dimension"]
    return []


def check_tiny_vocab(p: "PolicyConfig") -> list[str]:
    """The tiny backbone's vocabulary holds the action bins after the text ids (not so for a
    pretrained backbone, whose tokenizer comes with it)."""
    text_ids = p.backbone.vocab_size - p.n_bins
    if p.pretrained_path is not None or text_ids >= TINY_TEXT_IDS_MIN:
        return []
    return [f"policy.backbone.vocab_size={p.backbone.vocab_size} leaves {text_ids} text ids beside "
            f"policy.n_bins={p.n_bins} action ids; the built tokenizer needs {TINY_TEXT_IDS_MIN}: set "
            f"policy.backbone.vocab_size >= {p.n_bins + TINY_TEXT_IDS_MIN}"]


def check_gaussian(g: "GaussianConfig") -> list[str]:
    if not g.log_std_min < g.log_std_init < g.log_std_max:
        return [f"policy.gaussian.log_std_init={g.log_std_init} must lie strictly between log_std_min="
                f"{g.log_std_min} and log_std_max={g.log_std_max}"]
    return []


def check_flow(f: "FlowConfig") -> list[str]:
    if f.heads % f.kv_heads:
        return [f"policy.flow.heads={f.heads} must be a multiple of policy.flow.kv_heads={f.kv_heads}"]
    if not f.log_std_min < f.log_std_max:
        return [f"policy.flow.log_std_min={f.log_std_min} must be < policy.flow.log_std_max={f.log_std_max}"]
    return []
