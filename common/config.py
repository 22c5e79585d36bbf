"""One configuration schema for the whole system.

Each section is a dataclass; every field is declared with its default, a help string and the
values it accepts. YAML files in configs/ set values; dotted command-line overrides
(`actor.num_envs=4`) set them last. `load_config` merges and validates, and any unknown key,
wrong type or out-of-range value (nan and inf included: no float key gives them a meaning) raises
`ConfigError` naming the key, the value and what is allowed. Parameter names follow RLinf's where
they fit (`num_action_chunks`, `reward_type`, `logprob_type`, `rollout_ema_decay`, `ratio_clip_eps`,
`clip_ratio_c`, `entropy_bonus`, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: which key, which value, what is allowed."""


def opt(default: Any, help: str, *, choices: Sequence[Any] | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, structural: bool = False):
    """A config field: its default, a one-line help string and the values it accepts. `structural`:
    the key shapes the policy (its parameters or its action interface), so that a run resumed from
    a checkpoint, or one warm-started from a saved policy, must set it as that was trained
    (`structural_keys`)."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "structural": structural}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------- env
@dataclass
class EnvConfig:
    id: str = opt("PushCube-v1", "ManiSkill3 env id (e.g. PushCube-v1, PickCube-v1) or the built-in "
                  "pixel task 'PixelReach-v0'")
    instruction: Optional[str] = opt(None, "language instruction given to the policy; null takes the "
                                     "built-in one for the task")
    obs_mode: str = opt("rgb", "ManiSkill observation mode the wrapper reads images from",
                        choices=["rgb", "rgbd"])
    camera: str = opt("base_camera", "ManiSkill camera whose RGB image the policy sees")
    camera_pose: Optional[List[float]] = opt(None, "where env.camera looks from and at: [eye x, y, z, target "
                                             "x, y, z] in metres, world frame (ManiSkill's sensor_configs, "
                                             "pose = look_at(eye, target)); null: the task's own")
    camera_fov: Optional[float] = opt(None, "env.camera's field of view in radians; null: the task's own",
                                      gt=0.0, lt=3.14)
    render_size: Optional[int] = opt(None, "render env.camera at this square size in pixels, e.g. "
                                     "policy.image_size: nothing to resize, and at 64 px 4x fewer pixels "
                                     "than the default 128 to render on a CPU; null: the camera's own size, "
                                     "resized to policy.image_size", ge=16, le=1024)
    robot_visual: str = opt("mesh", "how the cameras draw the robot: mesh (its visual meshes, ~135 k "
                            "triangles for the Panda) or hull (its convex collision hulls, ~2 k: the same "
                            "shape, faceted; a 64 px frame on the software renderer ~4x cheaper, "
                            "actors/envs/robot_hulls.py)", choices=["mesh", "hull"])
    robot_uids: Optional[str] = opt(None, "ManiSkill robot to load (gym.make's robot_uids), e.g. "
                                    "panda_wristcam: the Panda with a camera on its hand "
                                    "(env.camera: hand_camera); null: the task's own")
    use_proprio: bool = opt(False, "also give the policy the robot's proprioceptive state")
    control_mode: str = opt("pd_ee_delta_pose", "ManiSkill controller; pd_ee_delta_pose is 7-D like OpenVLA")
    reward_mode: str = opt("normalized_dense", "ManiSkill reward mode; a dense one with episodes that "
                           "end at success pays a policy to avoid success (pair it with "
                           "ignore_terminations, or use sparse)", choices=["sparse", "dense", "normalized_dense"])
    sim_backend: str = opt("physx_cpu", "physics backend: physx_cpu (one process per env) or "
                           "physx_cuda (all envs batched on the GPU)", choices=["physx_cpu", "physx_cuda"])
    render_backend: str = opt("cpu", "renderer device: cpu (software Vulkan) or gpu",
                              choices=["cpu", "gpu"])
    max_episode_steps: Optional[int] = opt(None, "episode time limit in env steps; null keeps the "
                                           "task's own", ge=1)
    auto_reset: bool = opt(True, "reset an env as soon as its episode ends (training needs this)")
    ignore_terminations: bool = opt(False, "never end an episode on success/failure, only on the time limit")
    seed: int = opt(0, "base seed; actor a seeds its envs with seed + 1000*a, and the k-th episode "
                    "of its env i starts from a seed derived from (that seed, i, k)", ge=0)
    sim_latency_ms: float = opt(0.0, "a modelled simulator on other hardware: each env step of an actor's "
                                "env batch takes at least this many ms of wall time, slept without holding a "
                                "core (actors only; see actors/envs/latency.py). 0: the env's own speed",
                                ge=0.0)
    use_fixed_reset_state_ids: bool = opt(False, "reset to a fixed sequence of initial states: every "
                                          "reset() starts the sequence over (reproducible evaluation)")
    replay_failed_starts: float = opt(0.0, "training only: the probability that an env's next episode "
                                      "starts from the initial state of a recent unsolved episode (each "
                                      "replayed until solved, at most 3 times) instead of a fresh one, so "
                                      "the starts the policy fails train more often; 0: always fresh "
                                      "(actors/envs/base.py ResetSeeds)", ge=0.0, le=1.0)


# ------------------------------------------------------------------------------------ policy
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


# ------------------------------------------------------------------------------------- actor
@dataclass
class ActorConfig:
    num_envs: int = opt(2, "environments per actor process", ge=1)
    rollout_length: int = opt(16, "policy steps T per trajectory segment", ge=1)
    device: str = opt("cpu", "torch device of the actor's policy copy (cpu, cuda, cuda:1, ...)")
    backpressure: str = opt("block", "when the learner is slow: block the actor, or drop its oldest "
                            "unsent segment (counted)", choices=["block", "drop_oldest"])
    max_segments_in_flight: Optional[int] = opt(
        None, "block mode: segments sent but not yet taken by the learner, beyond which the actor "
        "waits before collecting another; each queued segment adds a version of policy lag "
        "(null: this actor's share of one update, as in --sync; 0: no limit)", ge=0)
    seed: int = opt(0, "base seed of the action sampler", ge=0)


# ----------------------------------------------------------------------------------- learner
@dataclass
class LearnerConfig:
    max_steps: int = opt(200, "stop after this many learner updates", ge=1)
    max_env_steps: Optional[int] = opt(None, "also stop after this many env steps (null: no limit)", ge=1)
    max_time_s: Optional[float] = opt(None, "also stop after this many seconds of training, counted "
                                      "from the learner's first wait for data (null: no limit)", gt=0.0)
    target_success: Optional[float] = opt(None, "also stop once the actors' episodes succeed this often: "
                                          "the success rate over the newest learner.target_success_episodes "
                                          "episodes trained on, at or above it over two such windows in a "
                                          "row (null: no target)", gt=0.0, le=1.0)
    target_success_episodes: int = opt(128, "how many of the newest episodes learner.target_success is "
                                       "measured over (whole updates: at least this many)", ge=1)
    batch_trajectories: int = opt(8, "env trajectories of rollout_length steps in one update, across "
                                  "all ranks (a segment from an actor with B envs holds B of them)", ge=1)
    micro_batch_size: int = opt(32, "samples (time steps x envs) per forward/backward on one rank", ge=1)
    lr: float = opt(1e-4, "learning rate of the policy (LoRA) parameters", gt=0.0)
    value_lr: float = opt(1e-3, "learning rate of the value head", gt=0.0)
    adam_beta1: float = opt(0.9, "Adam beta1", ge=0.0, lt=1.0)
    adam_beta2: float = opt(0.999, "Adam beta2", ge=0.0, lt=1.0)
    adam_eps: float = opt(1e-5, "Adam epsilon", gt=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    clip_grad: float = opt(1.0, "gradient-norm clip (0 disables), one norm over the policy and the value "
                           "head together: a value loss far above the policy's shrinks the policy's step "
                           "(algorithm.value_norm keeps it O(1))", ge=0.0)
    lr_warmup_steps: int = opt(0, "linear LR warm-up in learner updates", ge=0)
    lr_decay_style: str = opt("constant", "the policy's lr after warm-up: constant, or linear from learner.lr "
                              "at the first update to learner.min_lr at update learner.lr_decay_iters, "
                              "then held (the end of a run moves the policy less)",
                              choices=["constant", "linear"])
    lr_decay_iters: Optional[int] = opt(None, "learner updates the linear decay spans (null: learner.max_steps)",
                                        ge=1)
    min_lr: float = opt(0.0, "the policy's lr where the linear decay ends", ge=0.0)
    critic_warmup_steps: int = opt(0, "first updates in which only the value head trains (the policy's "
                                   "lr is 0): a warm start's critic, fit to demonstrations, first learns "
                                   "the RL returns before its advantages move the policy", ge=0)
    zero_stage: int = opt(3, "DeepSpeed ZeRO stage", choices=[0, 1, 2, 3])
    precision: str = opt("auto", "auto = bf16 on GPU, fp32 on CPU", choices=["auto", "fp32", "bf16"])
    max_policy_lag: int = opt(4, "drop segments produced more than this many versions ago", ge=0)
    max_abs_reward: float = opt(1e4, "drop segments holding a reward with |r| above this (counted as "
                                "bad_reward): a finite but absurd reward would swamp the gradient", gt=0.0)
    max_nonfinite_steps: int = opt(5, "stop the run (non-zero exit) when this many optimizer steps in a row "
                                   "had a non-finite loss or gradient norm; each one is skipped and counted "
                                   "(system/nonfinite_steps)", ge=1)
    max_poisoned_columns: int = opt(4, "an actor whose columns came out non-finite in an update this many times "
                                    "(each dropped before training) is banned: its segments and requests are "
                                    "refused from then on (0: never)", ge=0)
    publish_interval: int = opt(1, "publish weights every this many updates", ge=1)
    rollout_ema_decay: float = opt(0.0, "EMA of published weights: pub <- d*pub + (1-d)*theta "
                                   "(0 = publish the learner's weights as they are)", ge=0.0, lt=1.0)
    dist_timeout_minutes: int = opt(120, "collective time-out; ranks idle while actors are slow", ge=1)
    starvation_timeout_s: float = opt(60.0, "a learner rank that receives no segment for this long logs one "
                                      "line per interval naming the actors it last heard from (0: never)", ge=0.0)
    min_actors: int = opt(0, "before its first update the learner waits until this many actors have joined "
                          "(the evaluator not counted): a fleet's first updates then hold every host's data, and a "
                          "short budget is not spent before the slowest host joins (0: start with the first data)",
                          ge=0)


# --------------------------------------------------------------------------------- algorithm
@dataclass
class AlgorithmConfig:
    adv_type: str = opt("vtrace", "how a step's advantage is estimated: vtrace (the critic's V-trace "
                        "targets, PPO with a value loss) or grpo (critic-free, group-relative: "
                        "algorithm.group_size episodes start from one initial state and each episode's "
                        "return is compared with its group's; common/groups.py)", choices=["vtrace", "grpo"])
    group_size: int = opt(8, "grpo: episodes per group, started from one initial state (an actor's envs "
                          "take a group's episodes in turn)", ge=2)
    gamma: float = opt(0.99, "discount per policy step (per chunk with reward_type chunk_level)",
                       ge=0.0, le=1.0)
    vtrace_lambda: float = opt(1.0, "V-trace lambda (trace cutting, like GAE's lambda)", ge=0.0, le=1.0)
    off_policy_correction: str = opt("vtrace", "vtrace: importance-weighted targets and advantages "
                                     "for data from older policies; none: treat stale data as on-policy "
                                     "(λ-returns and GAE; the PPO ratio is still π/μ) — the ablation",
                                     choices=["vtrace", "none"])
    rho_bar: float = opt(1.0, "V-trace clip of importance weights in targets/advantages", gt=0.0)
    c_bar: float = opt(1.0, "V-trace clip of the traces", gt=0.0)
    policy_loss: str = opt("behavior_clip", "PPO objective: behavior_clip clips pi/mu around the behaviour "
                           "policy mu; decoupled clips pi/pi_prox around the learner's weights at the "
                           "update's start and weights each element by pi_prox/mu (masked above "
                           "behave_weight_threshold), so stale data does not cut the step short",
                           choices=["behavior_clip", "decoupled"])
    behave_weight_threshold: float = opt(2.0, "decoupled loss: elements whose behaviour weight pi_prox/mu "
                                         "exceeds this are masked out", gt=1.0)
    ratio_clip_eps: float = opt(0.2, "PPO clip epsilon of the ratio (pi/mu, or pi/pi_prox when decoupled)",
                                gt=0.0)
    clip_ratio_c: Optional[float] = opt(None, "dual-clip constant c (> 1) for negative advantages; "
                                        "null disables", gt=1.0)
    entropy_bonus: float = opt(0.0, "entropy coefficient", ge=0.0)
    value_loss_coef: float = opt(0.5, "weight of the value loss", ge=0.0)
    value_loss_type: str = opt("mse", "value loss", choices=["mse", "huber"])
    huber_delta: float = opt(1.0, "Huber loss delta", gt=0.0)
    value_clip: Optional[float] = opt(None, "clip new values to old +- this (null disables)", gt=0.0)
    value_norm: bool = opt(False, "the value head predicts returns normalised by a running mean and std of "
                           "the V-trace targets (learner/value_norm.py): the value loss stays O(1) at any "
                           "reward scale, so its gradient cannot swamp the policy's in the global "
                           "gradient-norm clip (learner.clip_grad)")
    value_norm_decay: float = opt(0.99, "decay per learner update of value_norm's running statistics",
                                  ge=0.0, lt=1.0)
    value_augment_shift: int = opt(0, "random-shift augmentation of the critic's image in the PPO epochs "
                                   "(DrQ): pad by this many edge pixels, crop back at a random offset. The "
                                   "policy's image and the V-trace targets are not shifted. Needs "
                                   "policy.value_encoder cnn (a critic that reads the image)", ge=0)
    normalize_advantages: bool = opt(True, "normalise advantages per batch")
    advantage_scale: float = opt(1.0, "multiply advantages by this after normalisation", gt=0.0)
    update_epochs: int = opt(1, "passes over each batch", ge=1)
    num_minibatches: int = opt(1, "minibatches per pass (per rank)", ge=1)
    reward_type: str = opt("chunk_level", "chunk_level: one reward per action chunk (sum over its "
                           "steps); action_level: one per env step", choices=["chunk_level", "action_level"])
    logprob_type: str = opt("token_level", "granularity of log-probs and ratios",
                            choices=["token_level", "action_level", "chunk_level"])


# --------------------------------------------------------------------------------- transport
@dataclass
class TransportConfig:
    bind_host: str = opt("127.0.0.1", "interface the learner binds; a public one needs CURVE keys "
                         "or allow_insecure_public_bind")
    advertise_host: Optional[str] = opt(None, "address actors should connect to (null: bind_host, or "
                                        "this host's name when binding 0.0.0.0)")
    control_port: int = opt(5555, "learner rank 0 control (ROUTER) port", ge=1, le=65535)
    weights_port: int = opt(5556, "learner rank 0 weight-server port", ge=1, le=65535)
    trajectory_port: int = opt(5560, "learner rank r pulls trajectories on trajectory_port + r",
                               ge=1, le=65535)
    send_hwm: int = opt(4, "segments queued per actor before backpressure", ge=1)
    recv_hwm: int = opt(8, "segments queued per learner rank before actors are pushed back", ge=1)
    max_message_mb: int = opt(512, "largest accepted message (all frames), MiB", ge=1)
    reuse_receive_buffers: bool = opt(True, "learner ranks keep freed memory mapped (glibc) so ZeroMQ reuses "
                                      "it for the next segments instead of faulting in fresh pages (up to "
                                      "~1 ms per 8 MB segment); a rank may then hold up to 256 MiB it freed")
    heartbeat_interval_s: float = opt(1.0, "seconds between heartbeats", gt=0.0)
    heartbeat_timeout_s: float = opt(10.0, "an actor (or the learner) silent this long is gone", gt=0.0)
    keys_dir: Optional[str] = opt(None, "CURVE keys directory made by `asyncvla keygen`; null: no "
                                  "encryption (loopback only unless allow_insecure_public_bind)")
    allow_insecure_public_bind: bool = opt(False, "allow binding a non-loopback interface without CURVE")
    linger_ms: int = opt(1000, "at close, wait at most this long for queued messages to leave", ge=0)
    reconnect_max_s: float = opt(5.0, "longest back-off between attempts to reach a learner that is gone",
                                 gt=0.0)


# ----------------------------------------------------------------------------------- logging
@dataclass
class LoggingConfig:
    output_dir: str = opt("runs", "root of run directories")
    experiment_name: str = opt("asyncvla", "run directory name under output_dir")
    progress: bool = opt(True, "show a console progress line")
    level: str = opt("INFO", "log level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    backends: List[str] = opt(["tensorboard"], "metric backends (common/trackers.py): tensorboard (RUN/tb), "
                              "wandb, swanlab (optional extras: pip install -e .[wandb] / .[swanlab])",
                              choices=["tensorboard", "wandb", "swanlab"])
    project: str = opt("asyncvla", "wandb / swanlab project")
    tracker_mode: str = opt("online", "wandb / swanlab: online (uploads; needs a key) or offline (local files "
                            "under the run directory, uploaded later with `wandb sync` / `swanlab sync`)",
                            choices=["online", "offline"])


# -------------------------------------------------------------------------------- checkpoint
@dataclass
class CheckpointConfig:
    save_interval: int = opt(50, "save a DeepSpeed checkpoint every this many updates (0: only at the end)",
                             ge=0)
    keep_last: int = opt(3, "keep this many most recent checkpoints", ge=1)
    resume: Optional[str] = opt(None, "a run directory (its latest complete checkpoint) or a checkpoint "
                                "directory to continue from")


# -------------------------------------------------------------------------------------- eval
@dataclass
class EvalConfig:
    eval_interval: int = opt(0, "evaluate every this many updates (0 disables)", ge=0)
    num_episodes: int = opt(8, "episodes per evaluation", ge=1)
    save_video: bool = opt(True, "write mp4 videos of evaluation episodes")
    greedy: bool = opt(True, "evaluate with the most likely action tokens")
    num_envs: int = opt(8, "envs stepped together, in rounds; the initial states depend on it, so compare "
                        "evaluations made with the same value (a ManiSkill CPU env is a process that "
                        "takes ~15 s of a core to start)", ge=1)
    final_eval_timeout_s: float = opt(300.0, "how long `asyncvla train` waits for the evaluation of "
                                      "the last step after the learner ends", ge=0.0)


# ----------------------------------------------------------------------------- demonstrations
@dataclass
class CollectConfig:
    method: str = opt("auto", "who demonstrates: scripted (the pixel task's oracle, or a ManiSkill task's "
                      "scripted expert reading the privileged state, in the control mode RL uses: "
                      "actors/experts.py), motion_planning (ManiSkill's planner, converted to "
                      "env.control_mode), or auto (scripted for the pixel task, motion_planning for "
                      "ManiSkill tasks)", choices=["auto", "scripted", "motion_planning"])
    num_episodes: int = opt(200, "successful demonstration episodes to record", ge=1)
    action_noise: float = opt(0.3, "probability that a step executes a random action instead of the "
                              "demonstrator's (whose action stays the label): demos then cover states "
                              "off the demonstrator's path", ge=0.0, le=1.0)
    num_envs: int = opt(16, "envs stepped together while collecting (the pixel task's oracle)", ge=1)
    num_procs: int = opt(2, "worker processes of ManiSkill demonstrations (scripted: one env each; "
                         "motion_planning: planning and converting)", ge=1)
    seed: int = opt(7, "base seed of the demonstration episodes (apart from training's and "
                    "evaluation's)", ge=0)


# ---------------------------------------------------------------------------------------- sft
@dataclass
class LeRobotConfig:
    """How a dataset in LeRobot's format (sft.data names a directory with meta/info.json) maps onto
    what the policy reads (common/lerobot/read.py)."""
    camera: Optional[str] = opt(None, "the video feature the policy sees (e.g. observation.images.top); "
                                "null: the first video feature in meta/info.json")
    state: List[str] = opt(["observation.state"], "features concatenated, in this order, into the robot "
                           "state (read only when policy.state_dim > 0)")
    action: str = opt("action", "the feature holding the actions (policy.action_dim values per frame)")
    action_norm: str = opt("stats", "stats: a new policy bins each action dimension over the dataset's "
                           "own [q01, q99] (meta/stats.json; [min, max] where it has no quantiles), so "
                           "it acts in the dataset's units; none: the range comes from sft.action_range",
                           choices=["stats", "none"])


@dataclass
class SFTConfig:
    data: Optional[str] = opt(None, "demonstrations: a directory with trajectory.h5 + trajectory.json "
                              "(ManiSkill's format, e.g. from `asyncvla collect`) or the .h5 file, or "
                              "a LeRobot dataset directory (v2.1 or v3.0: meta/info.json; sft.lerobot)")
    max_demo_steps: Optional[int] = opt(None, "use at most this many demo steps (whole episodes, in "
                                        "file order; null: all)", ge=1)
    steps: int = opt(300, "optimizer steps", ge=1)
    batch_size: int = opt(64, "samples per optimizer step (all ranks)", ge=1)
    lr: float = opt(1e-3, "learning rate of the policy", gt=0.0)
    value_lr: float = opt(1e-3, "learning rate of the value head (critic warm-up)", gt=0.0)
    zero_stage: Optional[int] = opt(None, "DeepSpeed ZeRO stage of SFT's engine; null: learner.zero_stage. "
                                    "A model that fits one rank trains faster unpartitioned (0)",
                                    choices=[0, 1, 2, 3])
    micro_batch_size: Optional[int] = opt(None, "samples per forward/backward on one rank; null: "
                                          "learner.micro_batch_size", ge=1)
    action_range: str = opt("config", "binned range of each action dim of a new policy: config "
                            "(policy.action_low / action_high) or q99 (the demos' 1st-99th "
                            "percentiles, as OpenVLA normalises; saved with the policy). A LeRobot "
                            "dataset's stats take its place (sft.lerobot.action_norm=stats); a policy "
                            "continued from policy.pretrained_path keeps its own",
                            choices=["config", "q99"])
    value_loss_coef: float = opt(0.5, "weight of the critic's regression onto the demos' discounted "
                                 "returns (0: no critic warm-up)", ge=0.0)
    val_fraction: float = opt(0.1, "share of the episodes held out for validation loss and token "
                              "accuracy", ge=0.0, lt=1.0)
    eval_interval: int = opt(100, "evaluate success (sampled, as actors act) every this many steps "
                             "and at the end (0: only at the end)", ge=0)
    eval_episodes: int = opt(64, "episodes per success evaluation (fixed initial states)", ge=1)
    save_interval: int = opt(100, "checkpoint every this many steps (a rerun continues from the "
                             "latest complete one)", ge=1)
    augment_shift: int = opt(0, "random-shift augmentation: pad each training image by this many "
                             "edge pixels and crop it back at a random offset (DrQ; 0 = none)", ge=0)
    seed: int = opt(0, "seed of the split and of the minibatch order", ge=0)
    lerobot: LeRobotConfig = field(default_factory=LeRobotConfig)


# ------------------------------------------------------------------------------------ launch
@dataclass
class PlacementConfig:
    """Which CPU cores each kind of process may use (common/placement.py), as RLinf's
    cluster.component_placement. A spec is `all`, a core (3), a range (0-3) or a comma list of
    them (0-1,4,6-7), numbered as this machine's cores (os.sched_getaffinity)."""
    learner: str = opt("all", "cores of the learner ranks on each machine: rank r is pinned to the r-th "
                       "of even, disjoint slices (all of them when there are fewer cores than ranks) and "
                       "runs as many torch threads as it has cores; all: not pinned (shares the machine)")
    actors: str = opt("all", "cores of the local actor processes of `asyncvla train`: each actor may use "
                      "all of them (one torch thread each); must not overlap launch.placement.learner "
                      "unless one is all; all: not pinned")


@dataclass
class LaunchConfig:
    num_learner_ranks: int = opt(1, "learner processes on this machine (deepspeed --num_gpus)", ge=1)
    hostfile: Optional[str] = opt(None, "deepspeed hostfile for multi-node learners")
    actor_hostfile: Optional[str] = opt(None, "hosts that each run an actor fleet over ssh, one 'HOST slots=N' "
                                        "per line (N actors there; `asyncvla actors`)")
    num_local_actors: int = opt(2, "actor processes started beside the learner", ge=0)
    restart_actors: bool = opt(True, "restart a local actor that crashes")
    max_actor_restarts: int = opt(5, "give up on an actor after this many restarts", ge=0)
    sync: bool = opt(False, "serialise rollout and training (actors wait for new weights before each "
                     "segment): the synchronous baseline")
    master_port: int = opt(29500, "torch.distributed rendezvous port", ge=1, le=65535)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


# ------------------------------------------------------------------------------- load & check
# Keys older versions wrote that no longer exist; configs saved with them (run directories,
# checkpoints) still load, the key dropped.
RETIRED_KEYS = ("logging.log_interval_s",)


def _drop_retired(src):
    for key in RETIRED_KEYS:
        section, name = key.split(".")
        if isinstance(src, (dict, DictConfig)) and isinstance(src.get(section), (dict, DictConfig)) \
                and name in src[section]:
            src[section].pop(name)
    return src


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Schema defaults <- YAML file <- dotted overrides, validated. Returns a typed `Config`."""
    cfg = OmegaConf.structured(Config)
    sources = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            sources.append((str(path), _drop_retired(OmegaConf.load(path))))
        except Exception as e:  # YAML syntax errors
            raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. actor.num_envs=4)")
        sources.append((f"override '{item}'", OmegaConf.from_dotlist([item])))
    for where, src in sources:
        if not isinstance(src, DictConfig):
            raise ConfigError(f"{where}: expected a mapping of sections, got {type(src).__name__}")
        try:
            cfg = OmegaConf.merge(cfg, src)
        except OmegaConfBaseException as e:
            raise ConfigError(_explain(e, where)) from None
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(config)
    return config


def _yaml_problem(e: Exception) -> str:
    """One line of a YAML parser error: where (line, column: 1-based) and what it found. PyYAML's
    own text spans several lines ("while parsing ... in FILE, line L ... found ...")."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def validate(config: Config, on_this_machine: bool = True) -> None:
    """Range and choice checks declared on the fields, plus checks across sections; with
    `on_this_machine`, also that launch.placement names cores this machine has (not for a config
    received from another machine, which names that machine's cores)."""
    problems = []
    for key, value, meta in _walk(config):
        problems += _check_field(key, value, meta)
    problems += _check_action_range(config.policy)
    problems += _check_tiny_vocab(config.policy)
    problems += _check_flow(config.policy.flow)
    problems += _check_gaussian(config.policy.gaussian)
    problems += _check_value_augment(config)
    problems += _check_grpo(config)
    problems += _check_replay(config)
    problems += _check_lr_decay(config.learner)
    problems += _check_camera(config.env)
    if on_this_machine:
        problems += _check_placement(config.launch)
    if problems:
        raise ConfigError("\n".join(problems))


def _check_action_range(p: "PolicyConfig") -> list[str]:
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


# Text ids the built tiny tokenizer needs: <pad> <s> </s> <unk>, a family's special tokens (at most 4)
# and the 95 printable bytes (common/policy/backbone.build_tiny_tokenizer; a test keeps them in step).
TINY_TEXT_IDS_MIN = 103


def _check_tiny_vocab(p: "PolicyConfig") -> list[str]:
    """The tiny backbone's vocabulary holds the action bins after the text ids (not so for a
    pretrained backbone, whose tokenizer comes with it)."""
    text_ids = p.backbone.vocab_size - p.n_bins
    if p.pretrained_path is not None or text_ids >= TINY_TEXT_IDS_MIN:
        return []
    return [f"policy.backbone.vocab_size={p.backbone.vocab_size} leaves {text_ids} text ids beside "
            f"policy.n_bins={p.n_bins} action ids; the built tokenizer needs {TINY_TEXT_IDS_MIN}: set "
            f"policy.backbone.vocab_size >= {p.n_bins + TINY_TEXT_IDS_MIN}"]


def _check_gaussian(g: "GaussianConfig") -> list[str]:
    if not g.log_std_min < g.log_std_init < g.log_std_max:
        return [f"policy.gaussian.log_std_init={g.log_std_init} must lie strictly between log_std_min="
                f"{g.log_std_min} and log_std_max={g.log_std_max}"]
    return []


def _check_flow(f: "FlowConfig") -> list[str]:
    if f.heads % f.kv_heads:
        return [f"policy.flow.heads={f.heads} must be a multiple of policy.flow.kv_heads={f.kv_heads}"]
    if not f.log_std_min < f.log_std_max:
        return [f"policy.flow.log_std_min={f.log_std_min} must be < policy.flow.log_std_max={f.log_std_max}"]
    return []


def _check_value_augment(config: "Config") -> list[str]:
    shift, encoder = config.algorithm.value_augment_shift, config.policy.value_encoder
    if shift and encoder != "cnn":
        return [f"algorithm.value_augment_shift={shift} shifts the image of a critic that reads it; "
                f"policy.value_encoder={encoder!r} does not: set policy.value_encoder=cnn or the shift to 0"]
    return []


def _check_replay(config: "Config") -> list[str]:
    """Replayed starts are restored from their seeds, one training episode at a time."""
    p = config.env.replay_failed_starts
    if not p:
        return []
    if config.env.use_fixed_reset_state_ids:
        why = "env.use_fixed_reset_state_ids=true: fixed initial states are for evaluation"
    elif config.algorithm.adv_type == "grpo":
        why = "algorithm.adv_type=grpo: its groups already repeat each start"
    elif config.env.sim_backend == "physx_cuda":
        why = "env.sim_backend=physx_cuda: the batched simulator's partial resets do not take seeds"
    else:
        return []
    return [f"env.replay_failed_starts={p} cannot be used with {why}; set it to 0"]


def _check_lr_decay(lc: "LearnerConfig") -> list[str]:
    if lc.min_lr > lc.lr:
        return [f"learner.min_lr={lc.min_lr} is above learner.lr={lc.lr}: the decay only lowers the lr"]
    return []


def _check_grpo(config: "Config") -> list[str]:
    """GRPO's groups start their episodes from one initial state, each group its own."""
    if config.algorithm.adv_type != "grpo":
        return []
    if config.env.use_fixed_reset_state_ids:
        return ["algorithm.adv_type=grpo draws one initial state per group of episodes; "
                "env.use_fixed_reset_state_ids=true would repeat the same ones: set it to false"]
    if config.env.sim_backend == "physx_cuda":
        return ["algorithm.adv_type=grpo needs each group's episodes to start from one initial state, which "
                "the batched GPU simulator's partial resets cannot restore: set env.sim_backend=physx_cpu"]
    return []


def _check_camera(env: "EnvConfig") -> list[str]:
    pose = env.camera_pose
    if pose is None:
        return []
    if len(pose) != 6 or not all(math.isfinite(v) for v in pose):
        return [f"env.camera_pose={list(pose)} must have 6 finite values: eye x, y, z and target x, y, z "
                "(metres)"]
    if all(abs(a - b) < 1e-6 for a, b in zip(pose[:3], pose[3:])):
        return [f"env.camera_pose={list(pose)}: the eye and the target are the same point"]
    return []


def _check_placement(launch: "LaunchConfig") -> list[str]:
    from asyncvla.common import placement     # (here: placement.py imports ConfigError from this module)
    try:
        placement.plan(launch.placement, launch.num_learner_ranks, launch.num_local_actors,
                       placement.available_cores())
    except ConfigError as e:
        return [str(e)]
    return []


def structural_keys(cls: type | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """The dotted keys of the config dataclass `cls` (Config by default) declared structural=True
    (`opt`), relative to it, less those under `exclude`: the one declaration that a resumed run
    (learner/checkpoint/) and a saved policy loaded as policy.pretrained_path (VLAPolicy.build)
    are both checked against."""
    def keys(c, prefix):
        for f in dataclasses.fields(c):
            if dataclasses.is_dataclass(f.default_factory):          # a section: field(default_factory=Section)
                yield from keys(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata.get("structural"):
                yield prefix + f.name
    return [k for k in keys(cls or Config, "") if not any(k == e or k.startswith(e + ".") for e in exclude)]


def _walk(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _walk(value, key + ".")
        else:
            yield key, value, f.metadata


def _check_field(key, value, meta) -> list[str]:
    if value is None:
        return []
    # (nan passes every range check below, and inf a one-sided one: no key gives either a meaning)
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{key}={value!r} is not allowed; it must be a finite number"]
    choices = meta.get("choices")
    if choices is not None and isinstance(value, (list, tuple)):          # a list: each item one of them
        bad = [v for v in value if v not in choices]
        if bad or len(set(value)) != len(value):
            return [f"{key}={list(value)!r} is not allowed; each item once, each one of {list(choices)}"]
    elif choices is not None and value not in choices:
        return [f"{key}={value!r} is not allowed; choose one of {list(choices)}"]
    bounds = [("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")]
    for name, ok, sign in bounds:
        bound = meta.get(name)
        if bound is not None and isinstance(value, (int, float)) and not ok(value, bound):
            return [f"{key}={value!r} is out of range; it must be {sign} {bound}"]
    return []


def _explain(e: OmegaConfBaseException, where: str) -> str:
    """Turn an OmegaConf merge error into: which key, which value, what is allowed."""
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError", "KeyValidationError"):
        parent, _, leaf = key.rpartition(".")
        allowed = _section_keys(parent)
        hint = difflib.get_close_matches(leaf, allowed, n=1)
        did_you_mean = f" (did you mean '{parent + '.' if parent else ''}{hint[0]}'?)" if hint else ""
        return (f"{where}: unknown key '{key}'{did_you_mean}; allowed keys in "
                f"'{parent or '<top level>'}': {', '.join(allowed)}")
    value = getattr(e, "value", None) if hasattr(e, "value") else None
    expected = _field_type(key)
    return (f"{where}: bad value for '{key}'" + (f": {value!r}" if value is not None else "")
            + (f"; expected {expected}" if expected else "") + f" ({msg})")


def _section_keys(dotted: str) -> list[str]:
    node: Any = Config()
    for part in [p for p in dotted.split(".") if p]:
        node = getattr(node, part, None)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _field_type(dotted: str) -> str:
    parent, _, leaf = dotted.rpartition(".")
    node: Any = Config()
    for part in [p for p in parent.split(".") if p]:
        node = getattr(node, part, None)
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if f.name == leaf:
                return str(f.type).replace("typing.", "")
    return ""


# -------------------------------------------------------------------------------- conversions
def to_dict(config: Config) -> dict:
    """Plain nested dict (for checkpoints, the control channel, tensorboard text)."""
    return dataclasses.asdict(config)


def from_dict(data: dict) -> Config:
    """Inverse of `to_dict`, validated (used by actors that receive their config from the learner)."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), _drop_retired(OmegaConf.create(data)))
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, "received config")) from None
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(config, on_this_machine=False)    # (an actor's welcome, a checkpoint: another machine's cores)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def describe(markdown: bool = False) -> str:
    """The configuration reference: every key with its default, allowed values and help. With
    `markdown`, the same as a page: one table per section (docs/configuration.md is this output)."""
    if markdown:
        return _describe_markdown()
    lines = []
    for key, value, meta in _walk(Config()):
        allowed = ""
        if meta.get("choices") is not None:
            allowed = " one of " + "|".join(map(str, meta["choices"]))
        else:
            signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
            rng = [f"{signs[k]}{meta[k]}" for k in signs if meta.get(k) is not None]
            allowed = (" " + ",".join(rng)) if rng else ""
        lines.append(f"{key} = {value!r}{allowed}\n    {meta.get('help', '')}")
    return "\n".join(lines)


_MARKDOWN_HEADER = """<!-- Generated by `asyncvla config --describe --markdown` from common/config.py; do not edit.
     Regenerate: asyncvla config --describe --markdown > docs/configuration.md -->

# Configuration reference

One schema, `common/config.py`, declares every key with its default, the values it accepts and what
it means. A YAML file in `configs/` sets values; dotted overrides on the command line
(`actor.num_envs=4`) set them last. `asyncvla config CONFIG [overrides]` validates and prints the
result. An unknown key, a wrong type or an out-of-range value (for a number: nan and inf too) stops
with a message naming the key, the value and what is allowed.
"""


def _describe_markdown() -> str:
    sections: dict[str, list] = {}
    for key, value, meta in _walk(Config()):
        sections.setdefault(key.rpartition(".")[0], []).append((key, value, meta))
    out = [_MARKDOWN_HEADER]
    for section, rows in sections.items():
        out.append(f"## {section}\n")
        node: Any = Config()
        for part in section.split("."):
            node = getattr(node, part)
        doc = type(node).__doc__ or ""
        if doc and not doc.startswith(type(node).__name__ + "("):    # (not the dataclass's own signature)
            out.append(_md_text(" ".join(doc.split())) + "\n")
        out.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|")
        for key, value, meta in rows:
            out.append(f"| `{key}` | {_md_code(_field_type(key))} | {_md_code(_yaml_value(value))} | "
                       f"{_md_allowed(meta)} | {_md_text(meta.get('help', ''))} |")
        out.append("")
    return "\n".join(out)


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(list(value)) if isinstance(value, (list, tuple, ListConfig)) else str(value)


def _md_code(text: str) -> str:
    """Inline code that survives a markdown table cell: with a pipe or a backtick inside, HTML
    whose markdown characters are entities (markdown still reads emphasis and escapes in HTML)."""
    if "|" in text or "`" in text:
        return "<code>" + "".join(f"&#{ord(c)};" if c in "|`*_\\[]" else c for c in html.escape(text)) + "</code>"
    return f"`{text}`"


def _md_allowed(meta) -> str:
    if meta.get("choices") is not None:
        return ", ".join(_md_code(_yaml_value(c)) for c in meta["choices"])
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(html.escape(f"{signs[k]} {meta[k]}") for k in signs if meta.get(k) is not None)


def _md_text(text: str) -> str:
    """Prose for a table cell: code spans kept, elsewhere the characters markdown would read."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else
                   html.escape(p, quote=False).replace("*", "\\*").replace("|", "\\|") for p in parts)


def parse_overrides(items: List[str]) -> List[str]:
    """Accept `key=value` and `--key=value` forms from a command line."""
    return [i[2:] if i.startswith("--") else i for i in items]


__all__ = ["Config", "ConfigError", "load_config", "validate", "to_dict", "from_dict", "to_yaml",
           "describe", "parse_overrides", "ListConfig"]
