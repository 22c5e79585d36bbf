"""One configuration schema for the whole system.

Each section is a dataclass; every field is declared with its default, a help string and the
values it accepts. YAML files in configs/ set values; dotted command-line overrides
(`actor.num_envs=4`) set them last. `load_config` merges and validates, and any unknown key,
wrong type or out-of-range value (nan and inf included: no float key gives them a meaning) raises
`ConfigError` naming the key, the value and what is allowed. Parameter names follow RLinf's where
they fit (`num_action_chunks`, `reward_type`, `logprob_type`, `rollout_ema_decay`, `ratio_clip_eps`,
`clip_ratio_c`, `entropy_bonus`, ...).

One module per section, its schema and its checks together (env, policy, learner, algorithm,
runtime, data, launch); schema.py puts them together and validates, loading.py reads YAML and
overrides, describe.py writes the reference. Import from here: `from asyncvla.common.config import
load_config, Config`.
"""

from omegaconf import ListConfig

from asyncvla.common.errors import ConfigError

from .algorithm import AlgorithmConfig
from .data import CollectConfig, LeRobotConfig, SFTConfig
from .describe import describe
from .env import EnvConfig
from .learner import LearnerConfig
from .launch import LaunchConfig, PlacementConfig
from .loading import from_dict, load_config, parse_overrides, to_dict, to_yaml
from .policy import TINY_TEXT_IDS_MIN, BackboneConfig, FlowConfig, GaussianConfig, PolicyConfig
from .runtime import ActorConfig, CheckpointConfig, EvalConfig, LoggingConfig, TransportConfig
from .schema import Config, structural_keys, validate

__all__ = ["ActorConfig", "AlgorithmConfig", "BackboneConfig", "CheckpointConfig", "CollectConfig", "Config",
           "ConfigError", "EnvConfig", "EvalConfig", "FlowConfig", "GaussianConfig", "LaunchConfig", "LeRobotConfig",
           "LearnerConfig", "ListConfig", "LoggingConfig", "PlacementConfig", "PolicyConfig", "SFTConfig",
           "TINY_TEXT_IDS_MIN", "TransportConfig", "describe", "from_dict", "load_config", "parse_overrides",
           "structural_keys", "to_dict", "to_yaml", "validate"]
