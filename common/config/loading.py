"""Loading a config: schema defaults <- YAML file <- dotted overrides, validated, with errors that name the key; and the conversions to and from plain data."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import typing
from typing import Any, List, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .fields import ConfigError
from .schema import Config, validate


log = logging.getLogger("asyncvla.config")

# Keys older versions wrote that no longer exist; configs saved with them (run directories,
# checkpoints) still load, the key dropped.
RETIRED_KEYS = ("logging.log_interval_s",)
# Keys renamed, old -> new: the old name is read as the new one for one release, with a warning.
RENAMED_KEYS = {"env.replay_failed_starts": "env.retry_failed_starts",     # (0.1 -> 0.2: one meaning of "replay",
                "transport.trajectory_port": "transport.segment_port"}     #  and of "trajectory")


def upgrade_old_keys(src, where: str = "config"):
    """`src` (a mapping of sections) without the retired keys, and with the renamed ones under their
    new names (one warning line each; both names set is an error)."""
    def section(key):
        name, leaf = key.split(".")
        node = src.get(name) if isinstance(src, (dict, DictConfig)) else None
        return (node, leaf) if isinstance(node, (dict, DictConfig)) else (None, leaf)

    for key in RETIRED_KEYS:
        node, leaf = section(key)
        if node is not None and leaf in node:
            node.pop(leaf)
    for old, new in RENAMED_KEYS.items():
        node, leaf = section(old)
        if node is None or leaf not in node:
            continue
        new_leaf = new.split(".")[1]
        if new_leaf in node:
            raise ConfigError(f"{where}: both '{old}' and '{new}' are set; '{old}' is the old name of '{new}': keep one")
        log.warning("%s: '%s' is deprecated and will be removed in the next release: it is read as '%s'", where, old, new)
        node[new_leaf] = node.pop(leaf)
    return src


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Schema defaults <- YAML file <- dotted overrides, validated. Returns a typed `Config`."""
    cfg = OmegaConf.structured(Config)
    sources = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            sources.append((str(path), upgrade_old_keys(OmegaConf.load(path), f"config file '{path}'")))
        except Exception as e:  # YAML syntax errors
            raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. actor.num_envs=4)")
        sources.append((f"override '{item}'", upgrade_old_keys(OmegaConf.from_dotlist([item]), f"override '{item}'")))
    for where, src in sources:
        if not isinstance(src, DictConfig):
            raise ConfigError(f"{where}: expected a mapping of sections, got {type(src).__name__}")
        try:
            cfg = OmegaConf.merge(cfg, src)
        except OmegaConfBaseException as e:
            raise ConfigError(explain(e, where)) from None
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


def explain(e: OmegaConfBaseException, where: str) -> str:
    """Turn an OmegaConf merge error into: which key, which value, what is allowed."""
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    item = list_item_key(getattr(e, "object_type", None))
    if item and not key.startswith(item):        # (OmegaConf names a list item's key without its list)
        key = f"{item}.{key}"
    if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError", "KeyValidationError"):
        parent, _, leaf = key.rpartition(".")
        allowed = section_keys(parent)
        hint = difflib.get_close_matches(leaf, allowed, n=1)
        did_you_mean = f" (did you mean '{parent + '.' if parent else ''}{hint[0]}'?)" if hint else ""
        return (f"{where}: unknown key '{key}'{did_you_mean}; allowed keys in "
                f"'{parent or '<top level>'}': {', '.join(allowed)}")
    value = getattr(e, "value", None) if hasattr(e, "value") else None
    expected = field_type(key)
    return (f"{where}: bad value for '{key}'" + (f": {value!r}" if value is not None else "")
            + (f"; expected {expected}" if expected else "") + f" ({msg})")


def list_item_key(item_type) -> str:
    """'section.key[]' of the list field whose items are the dataclass `item_type` (env.tasks[]:
    TaskConfig), else ''."""
    if not dataclasses.is_dataclass(item_type):
        return ""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            if typing.get_args(typing.get_type_hints(section.default_factory).get(f.name)) == (item_type,):
                return f"{section.name}.{f.name}[]"
    return ""


def config_node(dotted: str) -> Any:
    """The section or list item (key[]: a default item) that a dotted key names."""
    node: Any = Config()
    for part in [p for p in dotted.split(".") if p]:
        if part.endswith("[]"):
            hints = typing.get_type_hints(type(node))
            node = typing.get_args(hints.get(part[:-2]))[0]()
        else:
            node = getattr(node, part, None)
    return node


def section_keys(dotted: str) -> list[str]:
    node = config_node(dotted)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def field_type(dotted: str) -> str:
    parent, _, leaf = dotted.rpartition(".")
    node = config_node(parent)
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if f.name == leaf:
                return str(f.type).replace("typing.", "")
    return ""


def to_dict(config: Config) -> dict:
    """Plain nested dict (for checkpoints, the control channel, tensorboard text)."""
    return dataclasses.asdict(config)


def from_dict(data: dict) -> Config:
    """Inverse of `to_dict`, validated (used by actors that receive their config from the learner)."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), upgrade_old_keys(OmegaConf.create(data), "received config"))
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "received config")) from None
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(config, on_this_machine=False)    # (an actor's welcome, a checkpoint: another machine's cores)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def parse_overrides(items: List[str]) -> List[str]:
    """Accept `key=value` and `--key=value` forms from a command line."""
    return [i[2:] if i.startswith("--") else i for i in items]
