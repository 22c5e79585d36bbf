"""Where each episode starts: one StartSchedule per env wrapper, built by `make_env` for its purpose.

    starts = StartSchedule.for_purpose("train", env_cfg, seed, num_envs, group_size, env_tasks)
    seed = starts.peek(i)                # the seed env i's next episode will reset with
    seed = starts.take(i)                # env i starts it now (its slot: starts.slot[i])
    retried = starts.ended(i, success)  # how env i's episode ended, before its next take
    starts.restart(seed)                 # an explicit reset(): re-seed, or start over (evaluation)

The purposes (PURPOSES): `train` hands out fresh starts (env.use_fixed_reset_state_ids: the same
ones at every reset), GRPO's groups of episodes from one start (group_size, the estimator's
episodes_per_start) and retries of failed starts (env.retry_failed_starts); `evaluate` starts over
at every reset(seed), so that an evaluation with the same seed sees the same initial states
whatever the policy, and its starts are held out by construction (seeds in [2^31, 2^32), where
training's and collection's are below 2^31); `collect` hands out fresh starts for demonstrations. The envs only ask for the
next start and say how an episode ended. With several tasks (env.tasks; `env_tasks`: the task of
each env) a group and a retried start stay within their task.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from asyncvla.actors.envs.base import task_per_env

PURPOSES = ("train", "evaluate", "collect")

HELD_OUT_BIT = 1 << 31   # set in every evaluation start, in no other (episode_seed, group_seed: 31 bits)
RETRY_TRIES = 3     # a failed start is retried at most this often (unless solved first)
RETRY_QUEUE = 64    # failed starts waiting for a retry; older ones drop out


def episode_seed(seed: int, env_index: int, episode: int) -> int:
    """Seed of episode `episode` of env `env_index`: a pure function, so evaluations repeat."""
    return int(np.random.SeedSequence([seed, env_index, episode]).generate_state(1)[0] & 0x7FFFFFFF)


def group_seed(seed: int, group: int) -> int:
    """Seed of every episode of group `group` (GRPO): one initial state for all of them."""
    return int(np.random.SeedSequence([seed, group, 0, 1]).generate_state(1)[0] & 0x7FFFFFFF)


class StartSchedule:
    """Which seed each env's next episode resets with, and the slot each episode takes.

    Slots number an actor's episodes in the order their seeds are handed out. Without groups the
    k-th episode of env i gets episode_seed(seed, i, k); with `fixed` (evaluation) every explicit
    reset() starts over at k = 0, so each evaluation sees the same initial states; otherwise k
    keeps counting and training sees fresh ones. With `group_size` G > 1 (GRPO) slots gG ..
    gG + G - 1 form group g and all get group_seed(seed, g), whichever env runs them: an env
    reserves its next slot when first asked for its next seed (`peek`), so that seeds handed out
    before an episode ends are never handed out twice. `slot[i]`: the slot of env i's episode.
    With several tasks (`env_tasks`) each task fills its own open group: a group never mixes tasks.

    With `retry_failed` p > 0 (training only, env.retry_failed_starts) the seed of an episode
    that ended unsolved (`ended`) is queued, and an env's next episode starts from the oldest
    queued one with probability p instead of a fresh one: a start is retried until it is solved,
    at most RETRY_TRIES times, so the starts a policy fails train more often than 1 in N.
    """

    def __init__(self, seed: int, num_envs: int, fixed: bool = False, group_size: int = 1,
                 retry_failed: float = 0.0, held_out: bool = False, env_tasks=None):
        if group_size > 1 and fixed:
            raise ValueError("fixed reset states and groups of episodes exclude each other")
        if retry_failed and (fixed or group_size > 1):
            raise ValueError("retrying failed starts is for training without groups of episodes: "
                             "not with fixed reset states or group_size > 1")
        if not 0.0 <= retry_failed <= 1.0:
            raise ValueError(f"retry_failed={retry_failed} is a probability: 0 <= p <= 1")
        self.seed, self.fixed, self.group_size = int(seed), fixed, int(group_size)
        self._held_out = HELD_OUT_BIT if held_out else 0
        self.count = np.zeros(num_envs, np.int64)
        self.slot = np.full(num_envs, -1, np.int64)
        self._reserved = np.full(num_envs, -1, np.int64)
        self._next_slot = 0
        self._task = task_per_env(env_tasks, num_envs)
        self._open: dict[int, int] = {}        # task -> next slot of its open group (groups: G slots each)
        self.retry_failed = float(retry_failed)
        self.retried = np.zeros(num_envs, np.int64)   # how often env i's current start was retried
        self._current = np.zeros(num_envs, np.int64)   # env i's current seed
        self._pending: dict[int, tuple[int, int]] = {}  # env -> (next seed, its retries)
        self._failed = collections.defaultdict(lambda: collections.deque(maxlen=RETRY_QUEUE))   # task -> starts
        self._rng = np.random.default_rng([int(seed), 0x5EED])

    def restart(self, seed: Optional[int] = None) -> None:
        if seed is not None:
            self.seed = int(seed)
        if seed is not None or self.fixed:
            self.count[:] = 0
            self._pending.clear()

    def peek(self, i: int) -> int:
        if self.group_size > 1:
            if self._reserved[i] < 0:
                self._reserved[i] = self._next_group_slot(int(self._task[i]))
            return group_seed(self.seed, int(self._reserved[i]) // self.group_size)
        if i not in self._pending:
            failed = self._failed[int(self._task[i])]
            if failed and self._rng.random() < self.retry_failed:
                self._pending[i] = failed.popleft()
            else:
                self._pending[i] = (episode_seed(self.seed, i, int(self.count[i])) | self._held_out, 0)
        return self._pending[i][0]

    def take(self, i: int) -> int:
        s = self.peek(i)
        if self.group_size == 1:
            self.slot[i], self._next_slot = self._next_slot, self._next_slot + 1
            self.retried[i] = self._pending.pop(i)[1]
        else:
            self.slot[i], self._reserved[i] = self._reserved[i], -1
        self._current[i] = s
        self.count[i] += 1
        return s

    def ended(self, i: int, success: bool) -> bool:
        """Env i's episode ended (before its next `take`): queue its start for a retry if it
        failed and retries are on. Returns whether that episode was itself a retry."""
        if self.retry_failed and not success and self.retried[i] < RETRY_TRIES:
            self._failed[int(self._task[i])].append((int(self._current[i]), int(self.retried[i]) + 1))
        return bool(self.retried[i] > 0)

    @property
    def restores_starts(self) -> bool:
        """Whether some episode must start again from a seed handed out before (GRPO's groups, retried
        starts): an env whose later resets take no seeds cannot serve this schedule."""
        return self.group_size > 1 or self.retry_failed > 0

    def _next_group_slot(self, task: int) -> int:
        """The next slot of `task`'s open group, opening a new group (the next G slots) when it is full."""
        slot = self._open.get(task)
        if slot is None or slot % self.group_size == 0:
            slot, self._next_slot = self._next_slot, self._next_slot + self.group_size
        self._open[task] = slot + 1
        return slot

    @classmethod
    def for_purpose(cls, purpose: str, env_cfg, seed: int, num_envs: int, group_size: int = 1,
                    env_tasks=None) -> "StartSchedule":
        """The schedule of envs built for `purpose` (PURPOSES) from `env_cfg` (an EnvConfig);
        `env_tasks`: the task of each env (None: one task)."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r}: one of {list(PURPOSES)}")
        if purpose != "train":
            return cls(seed, num_envs, fixed=purpose == "evaluate", held_out=purpose == "evaluate",
                       env_tasks=env_tasks)
        return cls(seed, num_envs, env_cfg.use_fixed_reset_state_ids, group_size, env_cfg.retry_failed_starts,
                   env_tasks=env_tasks)
