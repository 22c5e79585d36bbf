"""A modelled simulator: an env whose every step also takes a fixed wall time that holds no core.

On 2 CPU cores this project's envs step far faster, relative to training, than a GPU simulator
with a 7 B policy does (seed 002: 38.8 s of rollout against 32.3 s of training per PPO step).
`env.sim_latency_ms` adds the difference as sleep, as if the physics ran on other hardware: the
batch of envs advances one env step in that time, all envs together (as a batched GPU simulator
does), so a chunk of K steps takes K · sim_latency_ms more. It is a model of a cost profile, not
a simulator: only rollout actors wear it (evaluation and demo collection run at the env's speed).
"""

from __future__ import annotations

import time


class SimLatency:
    """Wraps a ChunkEnv; `step_chunk` sleeps `latency_ms` per env step of the chunk."""

    def __init__(self, env, latency_ms: float):
        if not latency_ms >= 0:
            raise ValueError(f"sim latency {latency_ms} ms must be >= 0")
        self.env, self.latency_s = env, latency_ms / 1000.0

    def step_chunk(self, actions):
        t0 = time.perf_counter()
        step = self.env.step_chunk(actions)
        left = self.latency_s * self.env.num_action_chunks - (time.perf_counter() - t0)
        if left > 0:      # the modelled step takes at least this long; the real one runs inside it
            time.sleep(left)
        return step

    def __getattr__(self, name):
        return getattr(self.env, name)
