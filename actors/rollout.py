"""The rollout loop's body: act on `num_envs` envs for T policy steps and cut one segment.

A segment holds T+1 observations (the last one bootstraps V), the sampled action tokens with
their token-level behaviour log-probs, rewards, terminated/truncated apart, the final observations
of truncated episodes and the stats of episodes that ended. Field names and shapes are the
protocol's (common/protocol.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


class InstructionCache:
    """Tokenized instructions by text: envs re-use a few instructions, tokenizing once is enough."""

    def __init__(self, policy):
        self.policy, self.cache = policy, {}

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        missing = [t for t in set(texts) if t not in self.cache]
        if missing:
            ids, mask = self.policy.tokenize(missing)
            self.cache.update({t: (ids[i], mask[i]) for i, t in enumerate(missing)})
        return (np.stack([self.cache[t][0] for t in texts]), np.stack([self.cache[t][1] for t in texts]))


@dataclass
class RolloutState:
    """What carries over from one segment to the next: the current observation and counters."""
    obs: dict
    env_steps: int = 0
    episodes: list = field(default_factory=list)


def start(env) -> RolloutState:
    return RolloutState(obs=env.reset())


def collect_segment(env, policy, tokenize: InstructionCache, state: RolloutState, T: int,
                    temperature: float, generator=None) -> tuple[dict, dict]:
    """Run T policy steps; return (arrays, info). `state` is advanced in place."""
    B = env.num_envs
    obs_seq, instr, masks, tokens, logps, rewards, term, trunc = [], [], [], [], [], [], [], []
    finals = {"index": [], "image": [], "instruction": [], "instruction_mask": [], "state": []}
    episodes, env_steps, act_s, env_s = [], 0, 0.0, 0.0
    for t in range(T):
        ids, mask = tokenize(list(env.instructions))
        obs_seq.append(state.obs)
        instr.append(ids)
        masks.append(mask)
        t0 = time.perf_counter()
        out = policy.act(state.obs["image"], ids, mask, state.obs.get("state"),
                         temperature=temperature, generator=generator)
        t1 = time.perf_counter()
        step = env.step_chunk(np.asarray(out.actions))
        env_s += time.perf_counter() - t1
        act_s += t1 - t0
        tokens.append(np.asarray(out.action_tokens))
        logps.append(np.asarray(out.logprobs, np.float32))
        rewards.append(np.asarray(step.reward, np.float32))
        term.append(np.asarray(step.terminated, np.uint8))
        trunc.append(np.asarray(step.truncated, np.uint8))
        _keep_truncation_finals(finals, t, step, ids, mask)
        episodes += step.episodes
        env_steps += int(step.env_steps)
        state.obs = step.obs
    ids, mask = tokenize(list(env.instructions))
    obs_seq.append(state.obs)
    instr.append(ids)
    masks.append(mask)

    arrays = {
        "image": np.stack([o["image"] for o in obs_seq]),
        "instruction": np.stack(instr).astype(np.int64),
        "instruction_mask": np.stack(masks).astype(np.uint8),
        "action_tokens": np.stack(tokens).astype(np.int64),
        "behavior_logp": np.stack(logps).astype(np.float32),
        "rewards": np.stack(rewards),
        "terminated": np.stack(term),
        "truncated": np.stack(trunc),
        "final_index": np.asarray(finals["index"], np.int64).reshape(-1, 2),
        "ep_return": np.asarray([e["return"] for e in episodes], np.float32),
        "ep_length": np.asarray([e["length"] for e in episodes], np.int64),
        "ep_success": np.asarray([e["success"] for e in episodes], np.uint8),
    }
    H, W = arrays["image"].shape[2:4]
    L = arrays["instruction"].shape[-1]
    arrays["final_image"] = _stack(finals["image"], (0, H, W, 3), np.uint8)
    arrays["final_instruction"] = _stack(finals["instruction"], (0, L), np.int64)
    arrays["final_instruction_mask"] = _stack(finals["instruction_mask"], (0, L), np.uint8)
    if "state" in state.obs:
        S = state.obs["state"].shape[-1]
        arrays["state"] = np.stack([o["state"] for o in obs_seq]).astype(np.float32)
        arrays["final_state"] = _stack(finals["state"], (0, S), np.float32)
    state.env_steps += env_steps
    info = {"env_steps": env_steps, "act_s": act_s, "env_s": env_s, "num_envs": B,
            "episodes": len(episodes)}
    return arrays, info


def _keep_truncation_finals(finals: dict, t: int, step, ids, mask) -> None:
    """Remember the final observation of each truncated env (its value bootstraps the return)."""
    if not len(step.done_index):
        return
    for row, b in enumerate(np.asarray(step.done_index)):
        if not step.truncated[b] or step.terminated[b]:
            continue
        finals["index"].append((t, int(b)))
        finals["image"].append(step.final_obs["image"][row])
        finals["instruction"].append(ids[b])           # the instruction of the episode that ended
        finals["instruction_mask"].append(mask[b])
        if "state" in step.final_obs:
            finals["state"].append(step.final_obs["state"][row])


def _stack(rows: list, empty_shape: tuple, dtype) -> np.ndarray:
    return np.stack(rows).astype(dtype) if rows else np.zeros(empty_shape, dtype)
