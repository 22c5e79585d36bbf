"""A LeRobot π0 / π0.5 policy directory (config.json "type": "pi0" / "pi05"), read without LeRobot:
its settings (LeRobot 0.4.3's PI0Config / PI05Config keys), its tensors by name, its normaliser
statistics and where its tokenizer is.

The network's sizes are not in config.json: LeRobot builds them from `paligemma_variant` and
`action_expert_variant` (openpi's Gemma variants, VARIANTS: "gemma_2b" and "gemma_300m"), a SigLIP
so400m/14 vision tower at image_resolution, and a vocabulary of 257,152. VARIANTS can take further,
smaller entries (the tests' tiny networks; LeRobot accepts only its two names), and a variant can
carry its own vision tower and vocabulary (LeRobot's: SIGLIP_SO400M, VOCAB).

The tokenizer is not in the directory either: LeRobot's tokenizer step (policy_preprocessor.json,
"tokenizer_processor") names it, "google/paligemma-3b-pt-224" (PaliGemma's SentencePiece
tokenizer, which puts <bos> first). It is looked for as a directory (a relative one from the policy
directory) or in the local Hugging Face cache (no download); a directory without it still loads and
acts on tokens given to it.

Every problem is one line (LeRobotDirError) naming the file, the key or the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..lerobot_dir import (ACTION_KEY, CONFIG, STATE_KEY, LeRobotDir, LeRobotDirError, features, int_setting, model_tensors,
                           norm_modes, processor_step, read_json, read_stats, read_weights, type_error)

TYPES = ("pi0", "pi05")
VOCAB = 257_152
TOKENIZER = "google/paligemma-3b-pt-224"


@dataclass(frozen=True)
class Siglip:
    """The vision tower's sizes (its image size is the policy's image_resolution)."""
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    patch_size: int = 14


SIGLIP_SO400M = Siglip()


@dataclass(frozen=True)
class Gemma:
    """openpi's Gemma variant: a language model's or the action expert's sizes."""
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = VOCAB
    vision: Siglip = SIGLIP_SO400M      # (read only for the PaliGemma variant)


VARIANTS = {
    "gemma_300m": Gemma(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_2b": Gemma(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
}


@dataclass(frozen=True)
class PI0Spec:
    """The settings of config.json that shape π0's network and its inputs and outputs."""
    type: str                                    # "pi0" or "pi05"
    paligemma: Gemma
    expert: Gemma
    image_keys: tuple[str, ...]                  # VISUAL input features, in config order
    state_dim: int
    action_dim: int
    chunk_size: int
    n_action_steps: int
    max_state_dim: int
    max_action_dim: int
    num_inference_steps: int
    image_resolution: tuple[int, int]            # (height, width)
    tokenizer_max_length: int
    min_period: float
    max_period: float
    dtype: str = "float32"
    normalization: dict = field(default_factory=dict)     # feature type -> mode

    @property
    def pi05(self) -> bool:
        return self.type == "pi05"

    def mode(self, ftype: str) -> str:
        return self.normalization.get(ftype, "IDENTITY")

    @classmethod
    def from_config(cls, config: dict, where: str) -> "PI0Spec":
        kind = config.get("type")
        if kind not in TYPES:
            raise type_error(where, kind, "pi0 / pi05")
        variants = {}
        for key, default in (("paligemma_variant", "gemma_2b"), ("action_expert_variant", "gemma_300m")):
            name = config.get(key, default)
            if name not in VARIANTS:
                raise LeRobotDirError(f"{where}: {key}={name!r}; known: {sorted(VARIANTS)}")
            variants[key] = VARIANTS[name]
        pg, expert = variants["paligemma_variant"], variants["action_expert_variant"]
        if (pg.num_heads, pg.num_kv_heads, pg.head_dim) != (expert.num_heads, expert.num_kv_heads, expert.head_dim):
            raise LeRobotDirError(f"{where}: the PaliGemma and expert variants' attention heads differ (they attend "
                                  "together: heads, key/value heads and head size must be the same)")
        inputs, outputs = features(config, "input_features", where), features(config, "output_features", where)
        inputs = dict(inputs)
        resolution = config.get("image_resolution", [224, 224])
        if (not isinstance(resolution, (list, tuple)) or len(resolution) != 2
                or not all(isinstance(v, int) and v > 0 for v in resolution) or resolution[0] != resolution[1]):
            raise LeRobotDirError(f"{where}: image_resolution={resolution!r}; allowed: [N, N] (PaliGemma's images "
                                  "are square)")
        empty = config.get("empty_cameras", 0)
        if isinstance(empty, bool) or not isinstance(empty, int) or empty < 0:
            raise LeRobotDirError(f"{where}: empty_cameras={empty!r}; allowed: an integer >= 0")
        for i in range(empty):                   # (as PI0Config.validate_features adds them)
            inputs.setdefault(f"observation.images.empty_camera_{i}", {"type": "VISUAL", "shape": [3, *resolution]})
        images = [k for k, f in inputs.items() if f["type"] == "VISUAL"]
        if not images:
            raise LeRobotDirError(f"{where}: input_features has no VISUAL feature (a camera)")
        max_state, max_action = (int_setting(config, "max_state_dim", where, 32),
                                 int_setting(config, "max_action_dim", where, 32))
        state = inputs.get(STATE_KEY, {"shape": [max_state]})
        action = outputs.get(ACTION_KEY, {"shape": [max_action]})
        if config.get("dtype", "float32") not in ("float32", "bfloat16"):
            raise LeRobotDirError(f"{where}: dtype={config['dtype']!r}; allowed: float32, bfloat16")
        rtc = config.get("rtc_config")
        if isinstance(rtc, dict) and rtc.get("enabled"):
            raise LeRobotDirError(f"{where}: rtc_config.enabled (real-time chunking) is not supported")
        spec = cls(
            type=kind, paligemma=pg, expert=expert, image_keys=tuple(images),
            state_dim=int(state["shape"][0]), action_dim=int(action["shape"][0]),
            chunk_size=int_setting(config, "chunk_size", where, 50),
            n_action_steps=int_setting(config, "n_action_steps", where, 50),
            max_state_dim=max_state, max_action_dim=max_action,
            num_inference_steps=int_setting(config, "num_inference_steps", where, 10),
            image_resolution=(int(resolution[0]), int(resolution[1])),
            tokenizer_max_length=int_setting(config, "tokenizer_max_length", where, 200 if kind == "pi05" else 48),
            min_period=float(config.get("min_period", 4e-3)), max_period=float(config.get("max_period", 4.0)),
            dtype=config.get("dtype", "float32"), normalization=norm_modes(config, where))
        if spec.state_dim > spec.max_state_dim or spec.action_dim > spec.max_action_dim:
            raise LeRobotDirError(f"{where}: the state ({spec.state_dim}) or action ({spec.action_dim}) is longer than "
                                  f"max_state_dim={spec.max_state_dim} / max_action_dim={spec.max_action_dim}")
        if spec.n_action_steps > spec.chunk_size:
            raise LeRobotDirError(f"{where}: n_action_steps={spec.n_action_steps} is above chunk_size={spec.chunk_size}")
        if spec.expert.width % 2:
            raise LeRobotDirError(f"{where}: the expert's width {spec.expert.width} is odd (its time features are "
                                  "sine-cosine pairs)")
        return spec


@dataclass
class PI0Dir(LeRobotDir):
    """A LeRobot π0 / π0.5 directory (spec: a PI0Spec), its tokenizer step's settings and where the
    tokenizer is (None: not found here)."""
    tokenizer_step: dict
    tokenizer_dir: Path | None


def read_policy_dir(path, weights: bool = True) -> PI0Dir:
    """The directory's contents; without `weights`, the tensors' shapes only (meta tensors read from
    model.safetensors' header)."""
    path = Path(path)
    if not path.is_dir():
        raise LeRobotDirError(f"{path}: not a directory (a LeRobot policy directory holds {CONFIG} and model.safetensors)")
    config = read_json(path / CONFIG)
    spec = PI0Spec.from_config(config, str(path / CONFIG))
    raw = read_weights(path, weights)
    stats = read_stats(path, spec, raw)
    step = processor_step(path, "tokenizer_processor") or {}
    return PI0Dir(path, config, spec, model_tensors(raw), stats, step,
                  find_tokenizer(path, step.get("tokenizer_name") or TOKENIZER))


def find_tokenizer(path: Path, name: str) -> Path | None:
    """The tokenizer's directory: `name` as a directory (relative: from the policy directory), or a
    Hub id already in the local Hugging Face cache; None when neither (no download here)."""
    for candidate in (Path(name), path / name):
        if candidate.is_dir() and any((candidate / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                                          "tokenizer_config.json")):
            return candidate
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        return None
