"""The rollout loop's body: act on `num_envs` envs for T policy steps and cut one segment.

A segment holds T+1 observations (the last one bootstraps V), the head's replay of each sampled
chunk with its behaviour log-probs per action entry, rewards, terminated/truncated apart, the
final observations of truncated episodes and the stats of episodes that ended. Field names and
shapes are the protocol's (common/transport/protocol/segments.py) and the head's (`replay_fields`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from asyncvla.common.transport.protocol import OBS_FIELDS, SEGMENT_FIELDS, final_field


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
    """What carries over from one segment to the next: the env's current observation."""
    obs: dict


def start(env) -> RolloutState:
    return RolloutState(obs=env.reset())


def collect_segment(env, policy, tokenize: InstructionCache, state: RolloutState, T: int,
                    temperature: float, generator=None, slots: bool = False) -> tuple[dict, dict]:
    """Run T policy steps; return (arrays named and typed as the segment schema and the policy
    head's replay fields, info). `state` is advanced in place. With `slots` (groups of episodes:
    common/advantages/grpo.py) info also holds each step's episode slot ("slots" int64 [T, B]), the
    return of each episode that ended ("ended": {slot: return}) and the slots still running
    ("running" [B])."""
    obs_seq, episodes, step_slots, ended = [], [], [], {}
    fields = {**SEGMENT_FIELDS, **policy.head.replay_fields()}
    steps = {k: [] for k in ("behavior_logp", "rewards", "terminated", "truncated", *policy.head.replay_fields())}
    finals = {"index": [], "rows": []}
    env_steps, act_s, env_s = 0, 0.0, 0.0
    for t in range(T):
        obs = _observation(state.obs, tokenize(list(env.instructions)))
        obs_seq.append(obs)
        t0 = time.perf_counter()
        out = policy.act(obs["image"], obs["instruction"], obs["instruction_mask"], obs.get("state"),
                         temperature=temperature, generator=generator)
        t1 = time.perf_counter()
        if slots:
            step_slots.append(env.episode_slots)
        step = env.step_chunk(np.asarray(out.actions))
        env_s += time.perf_counter() - t1
        act_s += t1 - t0
        for k, v in (*out.replay.items(), ("behavior_logp", out.logprobs), ("rewards", step.reward),
                     ("terminated", step.terminated), ("truncated", step.truncated)):
            steps[k].append(np.asarray(v))
        _keep_truncation_finals(finals, t, step, obs)
        episodes += step.episodes
        if slots:
            ended.update({int(step_slots[-1][e["env"]]): e["return"] for e in step.episodes})
        env_steps += int(step.env_steps)
        state.obs = step.obs
    obs_seq.append(_observation(state.obs, tokenize(list(env.instructions))))

    arrays = {k: np.stack([o[k] for o in obs_seq]) for k in OBS_FIELDS if k in obs_seq[0]}
    arrays.update({k: np.stack(v) for k, v in steps.items()})
    arrays["final_index"] = np.asarray(finals["index"], np.int64).reshape(-1, 2)
    for k in OBS_FIELDS:
        if k in arrays:
            rows = [r[k] for r in finals["rows"]]
            arrays[final_field(k)] = np.stack(rows) if rows else np.zeros((0, *arrays[k].shape[2:]))
    for k in ("return", "length", "success", "task"):
        arrays[f"ep_{k}"] = np.asarray([e[k] for e in episodes])
    arrays = {k: v.astype(fields[k].dtype, copy=False) for k, v in arrays.items()}
    retried = [e for e in episodes if e.get("retried")]
    info = {"env_steps": env_steps, "act_s": act_s, "env_s": env_s, "num_envs": env.num_envs,
            "episodes": len(episodes), "ep_retried": len(retried),
            "ep_retried_success": sum(bool(e["success"]) for e in retried)}
    if slots:
        info.update(slots=np.stack(step_slots), ended=ended, running=env.episode_slots)
    return arrays, info


def _observation(env_obs: dict, instruction: tuple[np.ndarray, np.ndarray]) -> dict:
    """The policy's observation: the env's (image, optional state) plus the tokenized instruction."""
    obs = {k: env_obs[k] for k in ("image", "state") if k in env_obs}
    obs["instruction"], obs["instruction_mask"] = instruction
    return obs


def _keep_truncation_finals(finals: dict, t: int, step, obs: dict) -> None:
    """Remember the final observation of each truncated env (its value bootstraps the return);
    its instruction is that of the episode that ended."""
    for row, b in enumerate(np.asarray(step.done_index)):
        if not step.truncated[b] or step.terminated[b]:
            continue
        finals["index"].append((t, int(b)))
        finals["rows"].append({k: step.final_obs[k][row] if k in step.final_obs else v[b]
                               for k, v in obs.items()})
