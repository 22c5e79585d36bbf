"""A config field (`opt`: default, help, allowed values) and the checks every field gets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Sequence

from asyncvla.common.errors import ConfigError

__all__ = ["ConfigError", "check_field", "opt", "walk"]


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


def walk(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from walk(value, key + ".")
        else:
            yield key, value, f.metadata


def check_field(key, value, meta) -> list[str]:
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
