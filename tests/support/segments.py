"""Segment specs and segments as an actor of a given action head builds them, for protocol,
transport and learner tests."""

from __future__ import annotations

import numpy as np

from asyncvla.common.transport import protocol as P
from asyncvla.common.transport.auth import actor_token, learner_key
from asyncvla.common.config import FlowConfig, PolicyConfig
from asyncvla.common.policy.heads import make_head
from asyncvla.common.transport.protocol import Limits, Segment, SegmentSpec

LIMITS = Limits.for_kind(P.SEGMENT, 64)


def make_spec(T=16, B=8, H=128, L=32, K=4, D=7, S=0, action_level=False, vocab=512, flow_steps=0,
              head: str | None = None, first_action_id: int | None = None, **extra) -> SegmentSpec:
    """A receiver's spec for T steps of a policy with chunk K x D, images H x H, instructions of L
    tokens, S state dims; its head `head` (default: autoregressive, or flow with flow_steps > 0)
    gives the replay fields, as `SegmentSpec.for_policy` would. B is each segment's envs (unused:
    any B is accepted)."""
    name = head or ("flow" if flow_steps else "autoregressive")
    cfg = PolicyConfig(action_head=name, num_action_chunks=K, action_dim=D,
                       flow=FlowConfig(num_steps=flow_steps or 4))
    h = make_head(cfg)
    return SegmentSpec(image_size=H, instruction_len=L, num_action_chunks=K, action_dim=D,
                       replay=tuple(h.replay_fields().items()), densities=h.densities, replay_check=h.check_replay,
                       state_dim=S, action_level_rewards=action_level, num_steps=T, vocab_size=vocab,
                       first_action_id=first_action_id, **extra)


def make_segment(spec: SegmentSpec | None = None, B: int = 8, seq: int = 0, actor_id: str = "actor-0",
                 truncations: int = 2, episodes: int = 3, rng=None) -> Segment:
    """A segment as an actor builds it: random contents consistent with the schema (its head's
    replay included), and the token that a learner's servers in this process (without CURVE) give
    `actor_id` (common/transport/auth.py)."""
    spec = spec or make_spec(B=B)
    rng = rng if rng is not None else np.random.default_rng(seq)
    episodes = min(episodes, spec.num_steps * B)     # an env ends at most one episode per policy step
    T, H, L, N, K, S = spec.num_steps, spec.image_size, spec.instruction_len, spec.num_tokens, \
        spec.num_action_chunks, spec.state_dim
    terminated = np.zeros((T, B), np.uint8)
    truncated = np.zeros((T, B), np.uint8)
    cut = rng.choice(T * B, size=truncations + 1, replace=False)
    truncated.flat[cut[:truncations]] = 1
    terminated.flat[cut[truncations:]] = 1
    final_index = np.argwhere(truncated == 1).astype(np.int64)
    n = len(final_index)
    vocab = spec.vocab_size or 512
    arrays = {
        "image": rng.integers(0, 256, (T + 1, B, H, H, 3), dtype=np.uint8),
        "instruction": rng.integers(0, vocab, (T + 1, B, L), dtype=np.int64),
        "instruction_mask": rng.integers(0, 2, (T + 1, B, L), dtype=np.uint8),
        # densities may exceed 1 (continuous actions); token log-probs are <= 0
        "behavior_logp": (rng.standard_normal((T, B, N)) * 3 if spec.densities
                          else -rng.random((T, B, N)) * 5).astype(np.float32),
        "rewards": rng.standard_normal((T, B, K) if spec.action_level_rewards else (T, B)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "final_index": final_index,
        "final_image": rng.integers(0, 256, (n, H, H, 3), dtype=np.uint8),
        "final_instruction": rng.integers(0, vocab, (n, L), dtype=np.int64),
        "final_instruction_mask": np.ones((n, L), np.uint8),
        "ep_return": rng.standard_normal(episodes).astype(np.float32),
        "ep_length": rng.integers(1, min(100, (spec.max_episode_steps or 99) + 1), episodes, dtype=np.int64),
        "ep_success": rng.integers(0, 2, episodes, dtype=np.uint8),
        "ep_task": rng.integers(0, spec.num_tasks, episodes, dtype=np.int64),
    }
    if S:
        arrays["state"] = rng.standard_normal((T + 1, B, S)).astype(np.float32)
        arrays["final_state"] = rng.standard_normal((n, S)).astype(np.float32)
    arrays.update(replay_arrays(spec, T, B, rng))
    meta = {"actor_id": actor_id, "seq": seq, "policy_version": 3, "num_steps": T, "num_envs": B,
            "env_steps": T * B * K, "act_s": 0.25, "env_s": 1.5, "token": process_token(actor_id)}
    return Segment(meta=meta, arrays=arrays)


def replay_arrays(spec: SegmentSpec, T: int, B: int, rng) -> dict[str, np.ndarray]:
    """Random, valid values of the spec's replay fields: action ids among the action ids, a flow
    chain with one Gaussian step per chunk, unit-range actions near [-1, 1]."""
    dims = {"N": spec.num_tokens, "K": spec.num_action_chunks, "D": spec.action_dim}
    out = {}
    for name, f in spec.replay:
        shape = (T, B, *(dims.get(d, d) for d in f.dims))
        if f.bound == "action_ids":
            low = spec.first_action_id or 0
            out[name] = rng.integers(low, spec.vocab_size or 512, shape, dtype=np.int64)
        elif f.dtype == "uint8":               # a flow head's Gaussian steps: one per chunk
            out[name] = np.eye(shape[-1], dtype=np.uint8)[rng.integers(0, shape[-1], shape[:-1])]
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def process_token(actor_id: str) -> str:
    """The token this process's servers (without CURVE) accept from `actor_id`: what its welcome holds."""
    return actor_token(learner_key(None), actor_id, "", "test")


def as_bytearrays(frames) -> list[bytearray]:
    """What a receiver gets: one separate buffer per frame."""
    return [bytearray(memoryview(f).cast("B")) if not isinstance(f, bytes) else bytearray(f) for f in frames]
