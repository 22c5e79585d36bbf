"""Trajectory segments (actor -> learner rank): the schema, and the checks a receiver makes.

A segment holds T policy steps of B envs, time-major: T+1 observations (the last bootstraps V),
the behaviour log-probs, rewards, terminated and truncated apart, the final observation of each
truncated episode and the stats of the episodes that ended; and the action head's replay, what
the learner needs to score each action again (the head's `replay_fields`: a token head's action
tokens, a flow head's chains, a Gaussian head's sampled actions). SEGMENT_FIELDS is the part every
head shares; `SegmentSpec.for_policy` adds the head's and is the one place a receiver's
expectations are built (the learner, and the tests, use it).

Checks on receipt (`decode_segment`): names, dtypes and shapes; floats finite, flags 0/1, text
ids in the vocabulary (each once per group of fields an actor sends side by side); every field
that declares a range within it (`Field.bound`, `SegmentSpec.bounds`); the head's own rule
(`replay_check`); counters and episode stats against what the arrays can hold; and final_index
listing exactly the truncated, non-terminated steps. A failure raises ValidationError with a
countable reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .wire import (MAX_NAME_LEN, SEGMENT, Layout, Limits, Message, ValidationError, all_finite, check_meta,
                   decode, encode, expect_kind, total)

# The longest episode (env steps) a segment may report when the receiver does not know the env's
# time limit (SegmentSpec.max_episode_steps unset): far beyond any task's, yet a length that keeps
# the episode metrics readable.
MAX_EPISODE_STEPS = 1 << 24
# The ranges of a segment's float fields beyond finiteness (Field.bound; SegmentSpec.bounds), far
# outside what an honest actor sends, so that a buggy or hostile one cannot put a huge but finite
# value into a batch (a flow chain times 2e30 passes a finite check, and overflows the loss):
MAX_ABS_STATE = 1e4           # robot state: joint positions and velocities, poses
MAX_ABS_LOGP = 1e4            # a log-prob (token) or a log-density (continuous; positive where narrow)
MAX_ABS_UNIT = 1e2            # a flow chain or a sampled continuous action: the unit action space,
                              # from N(0, 1) noise
MAX_SEGMENT_SECONDS = 1e5     # meta act_s / env_s: an actor's time acting or stepping in one segment


@dataclass
class Segment:
    """One trajectory segment: meta (actor_id, seq, policy_version, num_steps T, num_envs B,
    env_steps, optional act_s/env_s, the actor's incarnation and token) and time-major arrays named
    as in `SegmentSpec.fields()`."""
    meta: dict
    arrays: dict[str, np.ndarray]


class Field(NamedTuple):
    """One segment array: its dtype tag, its dims, its role and the name of the range its values
    must lie in (`SegmentSpec.bounds`; None: finite is enough for a float, or a check of its own:
    rewards and episode returns are bounded by learner.max_abs_reward).

    dims: ints are fixed; letters are sizes: T steps, "T1" = T+1, B envs, H/W image, L instruction,
    S state, N action entries (K*D), K x D the chunk, R the K axis of action-level rewards, n
    truncations, E episodes. A head's replay fields give their dims after [T, B].
    role: "obs" [T+1, B, ...] (the last one bootstraps V), "step" [T, B, ...], "final" [n, ...]
    (the final observation of each truncated episode, named final_<obs>), "index" (final_index
    [n, 2]: the (t, b) of each truncation), "episode" [E] (stats of episodes that ended).
    """
    dtype: str
    dims: tuple
    role: str
    bound: str | None = None


# The observation, per env: name -> (dtype, dims after [T+1, B], range). Each also has a final_<name>.
_OBSERVATION = {"image": ("uint8", ("H", "W", 3), None), "instruction": ("int64", ("L",), None),
                "instruction_mask": ("uint8", ("L",), None), "state": ("float32", ("S",), "state")}
FINAL_PREFIX = "final_"

# What every segment holds, whatever the head: the one definition that actors (actors/rollout.py),
# the receiver (below) and the learner (learner/ingest.py, learner/update.py) iterate over.
SEGMENT_FIELDS: dict[str, Field] = {
    **{k: Field(dt, ("T1", "B", *d), "obs", r) for k, (dt, d, r) in _OBSERVATION.items()},
    "behavior_logp": Field("float32", ("T", "B", "N"), "step", "logp"),
    "rewards": Field("float32", ("T", "B", "R"), "step"),
    "terminated": Field("uint8", ("T", "B"), "step"),
    "truncated": Field("uint8", ("T", "B"), "step"),
    "final_index": Field("int64", ("n", 2), "index"),
    **{FINAL_PREFIX + k: Field(dt, ("n", *d), "final", r) for k, (dt, d, r) in _OBSERVATION.items()},
    "ep_return": Field("float32", ("E",), "episode"),
    "ep_length": Field("int64", ("E",), "episode"),
    "ep_success": Field("uint8", ("E",), "episode"),
    "ep_task": Field("int64", ("E",), "episode", "task"),      # index into the run's tasks (env.tasks)
}
OBS_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role == "obs")
FINAL_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role == "final")
STATE_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if "S" in f.dims)   # present only when S > 0
# Not time-major ([T(+1), B, ...]): everything else a segment holds, the replay included, is.
UNTIMED_FIELDS = tuple(k for k, f in SEGMENT_FIELDS.items() if f.role in ("final", "index", "episode"))
SEGMENT_META = {"actor_id": str, "seq": int, "policy_version": int, "num_steps": int,
                "num_envs": int, "env_steps": int}
# incarnation: drawn by an actor process at start; with actor_id it names the stream whose seqs a
# learner rank checks for repeats (a restarted actor keeps its id and starts again at seq 0).
# ep_retried / ep_retried_success: how many of the segment's ended episodes started from a retried
# start (env.retry_failed_starts), and how many of those succeeded.
SEGMENT_META_OPTIONAL = {"act_s": float, "env_s": float, "token": str, "incarnation": int,
                         "ep_retried": int, "ep_retried_success": int}
SEGMENT_SECONDS = ("act_s", "env_s")       # timings: in [0, MAX_SEGMENT_SECONDS]


def final_field(obs_name: str) -> str:
    """The name of an observation field's final-observation counterpart."""
    return FINAL_PREFIX + obs_name


def time_major(names) -> list[str]:
    """The names of arrays laid out [T(+1), B, ...] (columns are their axis 1)."""
    return [k for k in names if k not in UNTIMED_FIELDS]


@dataclass(frozen=True)
class SegmentSpec:
    """What a receiver expects: the dims (H = W = image_size, L, K x D = N, S), the head's replay
    fields (`replay`: (name, Field) pairs, dims after [T, B]), whether its behaviour log-probs are
    densities (`densities`: continuous actions, which may be positive), its own rule on the replay
    (`replay_check(arrays) -> problem or None`), and bounds: num_steps (exact T), vocab_size
    (token ids below it), first_action_id (action tokens at least it: the vocabulary's last ids),
    max_abs_reward (|reward| at most it), max_episode_steps (the env's episode limit: a reported
    length in [1, it]; unset: MAX_EPISODE_STEPS), and the advantage estimator's own arrays
    (`advantage_fields`: (name, Field) pairs, [T, B] each; `advantage_bounds`: (bound name, (low,
    high, reason)) pairs; common/advantages/). `for_policy` builds it from a config and a head."""
    image_size: int
    instruction_len: int
    num_action_chunks: int
    action_dim: int
    replay: tuple = ()
    densities: bool = False
    replay_check: Callable | None = None
    state_dim: int = 0
    action_level_rewards: bool = False
    num_steps: int | None = None
    vocab_size: int | None = None
    first_action_id: int | None = None
    max_abs_reward: float | None = None
    max_episode_steps: int | None = None
    num_tasks: int = 1
    advantage_fields: tuple = ()
    advantage_bounds: tuple = ()

    @classmethod
    def for_policy(cls, cfg, head, action_tokenizer) -> "SegmentSpec":
        """What a learner with config `cfg` (a Config), whose policy acts with `head` (an
        ActionHead) over `action_tokenizer`'s vocabulary, accepts from its actors."""
        from asyncvla.common.advantages import make_estimator   # (its files import this one)
        from asyncvla.common.config.env import episode_limit
        p, est = cfg.policy, make_estimator(cfg.algorithm)
        return cls(image_size=p.image_size, instruction_len=p.max_instruction_tokens,
                   num_action_chunks=p.num_action_chunks, action_dim=p.action_dim,
                   replay=tuple(head.replay_fields().items()), densities=head.densities,
                   replay_check=head.check_replay, state_dim=p.state_dim,
                   action_level_rewards=cfg.algorithm.reward_type == "action_level",
                   num_steps=cfg.actor.rollout_length, vocab_size=action_tokenizer.vocab_size,
                   first_action_id=action_tokenizer.first_id, max_abs_reward=cfg.learner.max_abs_reward,
                   max_episode_steps=episode_limit(cfg.env), num_tasks=max(1, len(cfg.env.tasks)),
                   advantage_fields=tuple(est.segment_fields().items()),
                   advantage_bounds=tuple(est.segment_bounds().items()))

    @property
    def num_tokens(self) -> int:
        return self.num_action_chunks * self.action_dim

    def bounds(self) -> dict[str, tuple[float, float, str]]:
        """Each Field.bound: (low, high, the reason a value outside counts as). Token log-probs are
        <= 0 (a hair above, for rounding); densities may be positive."""
        out = {"state": (-MAX_ABS_STATE, MAX_ABS_STATE, "out_of_range"),
               "logp": (-MAX_ABS_LOGP, MAX_ABS_LOGP if self.densities else 1e-3, "out_of_range"),
               "unit": (-MAX_ABS_UNIT, MAX_ABS_UNIT, "out_of_range"),
               "task": (0, self.num_tasks - 1, "out_of_range")}
        out.update(self.advantage_bounds)
        if self.vocab_size is not None:
            out["action_ids"] = (self.first_action_id or 0, self.vocab_size - 1, "bad_token")
        return out

    def fields(self) -> dict[str, Field]:
        """The expected arrays: name -> Field."""
        absent = () if self.state_dim > 0 else STATE_FIELDS
        fields = {k: v for k, v in SEGMENT_FIELDS.items() if k not in absent}
        if not self.action_level_rewards:
            fields["rewards"] = Field("float32", ("T", "B"), "step")
        fields.update({k: f._replace(dims=("T", "B", *f.dims), role="step") for k, f in self.replay})
        fields.update(self.advantage_fields)
        return fields


def encode_segment(segment: Segment) -> list:
    check_segment_meta(segment.meta)        # the sender finds a bad meta, not the receiver
    return encode(SEGMENT, segment.meta, {k: segment.arrays[k] for k in wire_order(segment.arrays)})


def wire_order(arrays: dict) -> list[str]:
    """The order an actor sends a segment's arrays in: the images (large: frames of their own),
    then the floats, the 0/1 flags and masks, the text ids, the rest; so that the fields of each
    group a receiver checks alike (`_group_checks`) lie side by side."""
    def group(name):
        a = arrays[name]
        return 0 if "image" in name else 1 if a.dtype == np.float32 else 2 if a.dtype == np.uint8 else \
            3 if "instruction" in name else 4
    return sorted(arrays, key=group)


@total
def decode_segment(frames: Sequence[Any], spec: SegmentSpec, limits: Limits) -> Segment:
    msg = decode(frames, limits)
    expect_kind(msg, SEGMENT)
    return Segment(meta=check_segment_meta(msg.meta), arrays=check_segment_arrays(msg, spec))


def check_segment_meta(meta: dict) -> dict:
    extra = set(meta) - set(SEGMENT_META) - set(SEGMENT_META_OPTIONAL)
    if extra:
        raise ValidationError("bad_meta", f"unknown meta keys {sorted(map(str, extra))[:5]}")
    check_meta(meta, SEGMENT_META)
    check_meta(meta, {k: t for k, t in SEGMENT_META_OPTIONAL.items() if k in meta})
    for key in ("seq", "policy_version", "env_steps", "num_steps", "num_envs", "incarnation",
                "ep_retried", "ep_retried_success"):
        if key in meta and meta[key] < (1 if key in ("num_steps", "num_envs") else 0):
            raise ValidationError("bad_meta", f"meta '{key}'={meta[key]} is out of range")
    for key in SEGMENT_SECONDS:
        if key in meta and not 0 <= meta[key] <= MAX_SEGMENT_SECONDS:
            raise ValidationError("bad_meta", f"meta '{key}'={meta[key]:.3g} is out of range [0, "
                                              f"{MAX_SEGMENT_SECONDS:g}] (seconds)")
    if meta.get("ep_retried_success", 0) > meta.get("ep_retried", 0):
        raise ValidationError("bad_meta", f"meta 'ep_retried_success'={meta['ep_retried_success']} exceeds "
                                          f"'ep_retried'={meta.get('ep_retried', 0)}")
    if not 0 < len(meta["actor_id"]) <= MAX_NAME_LEN:
        raise ValidationError("bad_meta", "meta 'actor_id' must be 1..256 characters")
    return meta


def check_segment_arrays(msg: Message, spec: SegmentSpec) -> dict[str, np.ndarray]:
    layout_key = msg.layout.key if msg.layout is not None else None
    key = None if layout_key is None else (layout_key, spec, msg.meta["num_steps"], msg.meta["num_envs"])
    checked = _SEGMENT_LAYOUTS.get(key) if key is not None else None
    if checked is None:
        dims = _check_segment_layout(msg, spec)
        checked = dims, _group_checks(msg.layout, spec)
        if key is not None:
            if len(_SEGMENT_LAYOUTS) >= _MAX_CACHED_LAYOUTS:
                _SEGMENT_LAYOUTS.clear()
            _SEGMENT_LAYOUTS[key] = checked
    _check_segment_values(msg, spec, *checked)
    return msg.arrays


_SEGMENT_LAYOUTS: dict[tuple, tuple] = {}
_MAX_CACHED_LAYOUTS = 256


def _check_segment_layout(msg: Message, spec: SegmentSpec) -> dict[str, int]:
    """Field names, dtypes and shapes against the spec and meta; returns the dims."""
    arrays, fields = msg.arrays, _fields_of(spec)
    if arrays.keys() != fields.keys():
        missing, extra = sorted(set(fields) - set(arrays)), sorted(set(arrays) - set(fields))
        raise ValidationError("bad_fields", f"missing {missing}, unexpected {extra}")
    dims = _segment_dims(arrays, spec, msg.meta)
    for name, (tag, shape, *_) in fields.items():
        if msg.tags[name] != tag:
            raise ValidationError("bad_dtype", f"'{name}' is {msg.tags[name]}, expected {tag}")
        want = tuple(dims[d] if type(d) is str else d for d in shape)
        if arrays[name].shape != want:
            raise ValidationError("bad_shape", f"'{name}' has shape {arrays[name].shape}, expected {want}")
    return dims


@functools.lru_cache(maxsize=64)
def _fields_of(spec: SegmentSpec) -> dict[str, Field]:
    return spec.fields()


@functools.lru_cache(maxsize=64)
def _ranged(spec: SegmentSpec) -> tuple:
    """(name, (low, high, reason)) of each field of the spec's that declares a range."""
    bounds = spec.bounds()
    return tuple((name, bounds[f.bound]) for name, f in _fields_of(spec).items()
                 if f.bound is not None and f.bound in bounds)


def _segment_dims(arrays: dict, spec: SegmentSpec, meta: dict) -> dict[str, int]:
    steps = arrays["terminated"]
    if steps.ndim != 2:
        raise ValidationError("bad_shape", f"'terminated' must be [T, B], got {steps.shape}")
    T, B = steps.shape
    if (T, B) != (meta["num_steps"], meta["num_envs"]):
        raise ValidationError("bad_shape", f"arrays have T={T}, B={B}; meta says num_steps="
                                           f"{meta['num_steps']}, num_envs={meta['num_envs']}")
    if spec.num_steps is not None and T != spec.num_steps:
        raise ValidationError("bad_shape", f"T={T}, expected {spec.num_steps}")
    first = lambda name: arrays[name].shape[0] if arrays[name].ndim else -1   # noqa: E731
    return {"T": T, "T1": T + 1, "B": B, "H": spec.image_size, "W": spec.image_size,
            "L": spec.instruction_len, "S": spec.state_dim, "N": spec.num_tokens,
            "R": spec.num_action_chunks, "n": first("final_index"), "E": first("ep_return"),
            "K": spec.num_action_chunks, "D": spec.action_dim}


class _Run(NamedTuple):
    """Fields whose bytes lie side by side in one frame (zero padding between), seen as one
    1-D array: `count` elements of `dtype` from `offset`."""
    names: tuple
    frame: int
    offset: int
    count: int
    dtype: np.dtype


def _runs(layout: Layout, names) -> list[_Run]:
    """The fields `names` of a message as runs: those packed one after another form one run; a
    field in a frame of its own is a run by itself."""
    runs: list[_Run] = []
    growing = None                       # index of the run the next packed field may extend
    for name, _, dtype, _, nbytes, frame, offset in layout.entries:
        if frame != 1:
            if name in names:
                runs.append(_Run((name,), frame, offset, nbytes // dtype.itemsize, dtype))
            continue
        if name not in names:
            growing = None               # a packed field of another kind lies between
            continue
        run = runs[growing] if growing is not None else None
        if run is not None and run.dtype == dtype:
            runs[growing] = run._replace(names=run.names + (name,),
                                         count=(offset + nbytes - run.offset) // dtype.itemsize)
        else:
            growing = len(runs)
            runs.append(_Run((name,), 1, offset, nbytes // dtype.itemsize, dtype))
    return runs


def check_groups(spec: SegmentSpec) -> list[tuple[str, str, Callable, tuple]]:
    """(reason, what is wrong, test of a 1-D array, field names) of the checks that hold alike for a
    group of fields: floats finite, flags and masks 0/1, text ids in the vocabulary."""
    fields = _fields_of(spec)
    floats = tuple(k for k, f in fields.items() if f.dtype == "float32")
    binary = tuple(k for k, f in fields.items() if f.dtype == "uint8" and "H" not in f.dims)
    text = tuple(k for k, f in fields.items() if f.dtype == "int64" and "L" in f.dims)
    checks = [("not_finite", "holds NaN or inf", all_finite, floats),
              ("bad_values", "must hold only 0/1", lambda a: not a.size or a.max() <= 1, binary)]
    vocab = spec.vocab_size
    if vocab is not None:
        # seen as uint64, a negative id is huge: one max() checks both ends
        checks.append(("bad_token", f"has ids outside [0, {vocab})",
                       lambda a: not a.size or a.view(np.uint64).max() < vocab, text))
    return checks


def _group_checks(layout: Layout, spec: SegmentSpec) -> list[tuple]:
    """`check_groups` with each group's fields as runs of the message (an actor sends each group's
    fields side by side: `wire_order`), so that each test runs once per group."""
    return [(reason, what, test, _runs(layout, set(names))) for reason, what, test, names in check_groups(spec)]


def _check_segment_values(msg: Message, spec: SegmentSpec, dims: dict, group_checks: list) -> None:
    arrays = msg.arrays
    _check_counters(msg.meta, dims, spec)
    for reason, what, test, runs in group_checks:
        for run in runs:
            if not test(np.ndarray((run.count,), run.dtype, msg.buffers[run.frame], run.offset)):
                bad = next((n for n in run.names if not test(arrays[n].reshape(-1))), "padding")
                raise ValidationError(reason, f"'{bad}' {what}")
    for name, (low, high, reason) in _ranged(spec):
        a = arrays[name]
        if a.size and (a.min() < low or a.max() > high):
            bad = a.min() if a.min() < low else a.max()
            raise ValidationError(reason, f"'{name}' holds {bad:.3g}, outside [{low:g}, {high:g}]"
                                  + (" (a positive log-probability)" if name == "behavior_logp" and bad > 0 else ""))
    problem = spec.replay_check(arrays) if spec.replay_check is not None else None
    if problem:
        raise ValidationError("bad_values", problem)
    _check_episodes(arrays, spec)
    rewards = arrays["rewards"]
    if spec.max_abs_reward is not None and rewards.size:
        largest = max(float(rewards.max()), -float(rewards.min()))
        if largest > spec.max_abs_reward:
            raise ValidationError("bad_reward", f"'rewards' holds |r| = {largest:.3g} > {spec.max_abs_reward} "
                                                "(learner.max_abs_reward)")
    # final_index lists exactly the steps that were truncated without terminating: the learner
    # bootstraps V(final obs) there and nowhere else.
    idx, T, B = arrays["final_index"], dims["T"], dims["B"]
    if idx.size and (idx.min() < 0 or idx[:, 0].max() >= T or idx[:, 1].max() >= B):
        raise ValidationError("bad_values", f"'final_index' rows outside [0, {T}) x [0, {B})")
    cut = arrays["truncated"] > arrays["terminated"]          # truncated=1, terminated=0 (both 0/1)
    marked = np.bincount(idx[:, 0] * B + idx[:, 1], minlength=T * B) if idx.size else None
    if (marked is None and cut.any()) or (marked is not None and not np.array_equal(marked, cut.ravel())):
        raise ValidationError("bad_values", "'final_index' must list each truncated, non-terminated "
                                            "(t, b) exactly once")


def _check_counters(meta: dict, dims: dict, spec: SegmentSpec) -> None:
    """Counters a sender reports, against what its arrays can hold: T policy steps of K env steps
    in each of B envs, and at most one episode end per env and policy step (an env resets after
    the chunk it ended in). A learner sums env_steps into its budget (learner.max_env_steps): one
    absurd count would end the run."""
    T, B = dims["T"], dims["B"]
    most = T * spec.num_action_chunks * B
    if meta["env_steps"] > most:
        raise ValidationError("bad_counter", f"meta 'env_steps'={meta['env_steps']} > {most}, what T={T} "
                                             f"policy steps x K={spec.num_action_chunks} x B={B} envs hold")
    if dims["E"] > T * B:
        raise ValidationError("bad_counter", f"{dims['E']} episodes ended in T={T} steps of B={B} envs "
                                             f"(at most {T * B})")


def _check_episodes(arrays: dict, spec: SegmentSpec) -> None:
    """Stats of the episodes that ended, which the learner averages into env/*: each length in
    [1, the env's episode limit], each |return| within length x max_abs_reward (no step's reward
    exceeds it, and an episode has at most one reward per env step). One absurd episode would
    otherwise own the metric for an update."""
    lengths, returns = arrays["ep_length"], arrays["ep_return"]
    if not lengths.size:
        return
    limit = spec.max_episode_steps or MAX_EPISODE_STEPS
    if lengths.min() < 1 or lengths.max() > limit:
        bad = int(lengths.min() if lengths.min() < 1 else lengths.max())
        source = "env.max_episode_steps" if spec.max_episode_steps else "MAX_EPISODE_STEPS"
        raise ValidationError("bad_counter", f"'ep_length' holds {bad}, outside [1, {limit}] ({source})")
    if spec.max_abs_reward is not None:
        # (float32 rounds a return that sits on the bound: a hair of slack)
        most = lengths.astype(np.float64) * spec.max_abs_reward * (1 + 1e-6)
        over = np.flatnonzero(np.abs(returns.astype(np.float64)) > most)
        if over.size:
            i = over[0]
            raise ValidationError("bad_reward", f"'ep_return' holds {float(returns[i]):.3g} for an episode of "
                                                f"{int(lengths[i])} steps; at most {int(lengths[i])} x "
                                                f"{spec.max_abs_reward} (learner.max_abs_reward)")
