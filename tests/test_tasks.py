"""Several tasks in one policy (env.tasks): the config and its refusals, how envs are dealt out,
starts that never mix tasks, and success counted per task. (Envs of several tasks in one actor,
end to end: tests/test_multitask_e2e.py.)"""

import subprocess
import sys

import numpy as np
import pytest

from asyncvla.actors.envs.starts import StartSchedule
from asyncvla.actors.envs.tasks import DEAL_PERIOD, Task, deal, instructions_in, tasks_of
from asyncvla.common.config import ConfigError, EnvConfig, load_config
from asyncvla.common.config.env import TaskConfig

THREE = "env.tasks=[{id: PushCube-v1}, {id: PullCube-v1, share: 2}, {id: PickCube-v1, max_episode_steps: 80}]"


def test_the_tasks_come_from_env_tasks_with_the_env_settings_they_do_not_set():
    cfg = load_config("configs/maniskill.yaml", [THREE])
    tasks = tasks_of(cfg.env)
    assert [t.id for t in tasks] == ["PushCube-v1", "PullCube-v1", "PickCube-v1"]
    assert len({t.instruction for t in tasks}) == 3                          # told apart by their words
    assert all(t.eval_instruction not in {u.instruction for u in tasks} for t in tasks)   # held out
    assert instructions_in(tasks, "eval") == [t.eval_instruction for t in tasks]
    assert instructions_in(tasks, "swapped") == [tasks[1].instruction, tasks[2].instruction, tasks[0].instruction]
    with pytest.raises(ValueError, match="two tasks or more"):
        instructions_in(tasks[:1], "swapped")
    assert [t.max_episode_steps for t in tasks] == [cfg.env.max_episode_steps] * 2 + [80]
    assert all(t.reward_mode == cfg.env.reward_mode for t in tasks)
    one = tasks_of(load_config("configs/maniskill.yaml").env)                # no env.tasks: env.id alone
    assert [t.id for t in one] == ["PushCube-v1"]


@pytest.mark.parametrize("override, words", [
    ("env.tasks=[{id: PushCube-v1}, {id: PixelReach-v0}]", "PixelReach-v0 has its own observations"),
    ("env.tasks=[{id: PushCube-v1}, {id: PushCube-v1}]", "each task once"),
    ("env.tasks=[{id: PushCube-v1, share: 0}]", "env.tasks[0].share=0.0 is out of range"),
    ("env.tasks=[{id: PushCube-v1, instruction: go}, {id: PullCube-v1, instruction: go}]", "same instruction"),
    ("env.tasks=[{id: PushCube-v1, shares: 1}]",
     "unknown key 'env.tasks[].shares' (did you mean 'env.tasks[].share'?)"),
    ("env.tasks=[{id: PullCube-v1}]", "env.tasks starts with 'PullCube-v1'"),
])
def test_a_mix_that_cannot_share_one_policy_is_refused_by_name(override, words):
    with pytest.raises(ConfigError) as e:
        load_config("configs/maniskill.yaml", [override])
    assert words in str(e.value)
    with pytest.raises(ConfigError, match="batched simulator runs one task"):
        load_config("configs/maniskill.yaml", [THREE, "env.sim_backend=physx_cuda"])


@pytest.mark.parametrize("tasks, overrides, words", [
    ("[{id: PushCube-v1}, {id: PixelReach-v0}]", [], "PixelReach-v0 has its own observations"),
    # the robot's state is each task's own (PullCube's has 3 more numbers): found by building each task
    ("[{id: PushCube-v1}, {id: PullCube-v1}]", ["env.use_proprio=true"],
     "env.tasks do not share one state size: PushCube-v1 25, PullCube-v1 28"),
])
def test_the_cli_refuses_observations_that_do_not_mix_in_one_line_with_exit_2(tasks, overrides, words):
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "config", "configs/maniskill.yaml",
                        f"env.tasks={tasks}", *overrides], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("asyncvla")]
    assert len(lines) == 1 and words in lines[0], r.stderr


def test_envs_are_dealt_out_in_proportion_to_the_shares_in_every_run_of_envs():
    tasks = [Task("a", "x", "x", 1.0), Task("b", "y", "y", 2.0), Task("c", "z", "z", 0.5)]
    whole = deal(tasks, 0, 700)
    assert np.array_equal(deal(tasks, 100, 50), whole[100:150])                    # one deal, any window
    share = np.array([1.0, 2.0, 0.5]) / 3.5
    for start, n in ((0, 7), (3, 7), (10, 21), (99, 350)):                        # any actor's envs
        counts = np.bincount(whole[start:start + n], minlength=3)
        assert np.all(np.abs(counts - n * share) < 2), (start, n, counts)
    assert np.array_equal(deal(tasks, DEAL_PERIOD + 5, 3), whole[5:8])             # the deal repeats
    assert deal(tasks[:1], 12, 3).tolist() == [0, 0, 0]


def test_groups_and_retried_starts_never_mix_tasks():
    env_tasks = np.array([0, 1, 0, 2, 1])
    seeds = StartSchedule(7, num_envs=5, group_size=3, env_tasks=env_tasks)
    rng = np.random.default_rng(0)
    task_of_slot = {}
    for i in range(5):
        seeds.take(i)
        task_of_slot[int(seeds.slot[i])] = env_tasks[i]
    for _ in range(60):                                   # envs end their episodes at random times
        for i in range(5):
            seeds.peek(i)
        for i in np.flatnonzero(rng.random(5) < 0.5):
            seeds.take(int(i))
            assert int(seeds.slot[i]) not in task_of_slot               # each slot once
            task_of_slot[int(seeds.slot[i])] = env_tasks[i]
    groups: dict = {}
    for slot, task in task_of_slot.items():
        groups.setdefault(slot // 3, set()).add(task)
    assert all(len(t) == 1 for t in groups.values())                    # a group holds one task
    assert {t for ts in groups.values() for t in ts} == {0, 1, 2}
    # retries: a task's failed start comes back only to an env of that task
    seeds = StartSchedule(3, num_envs=2, retry_failed=1.0, env_tasks=[0, 1])
    first = seeds.take(0)
    seeds.take(1)
    seeds.ended(0, success=False)                          # task 0's start failed
    seeds.ended(1, success=True)
    assert seeds.take(1) != first                          # env 1 (task 1) starts fresh
    assert seeds.take(0) == first                          # env 0 (task 0) retries it


def test_each_tasks_episodes_and_success_add_up_to_the_totals():
    from asyncvla.common.transport.protocol import Segment
    from asyncvla.learner.metrics import Metrics
    rng = np.random.default_rng(1)
    metrics = Metrics(None, 10, False, task_names=("PushCube-v1", "PullCube-v1", "PickCube-v1"))
    want_n, want_s = np.zeros(3), np.zeros(3)
    for _ in range(6):
        E = int(rng.integers(0, 9))
        task, success = rng.integers(0, 3, E), rng.integers(0, 2, E).astype(np.uint8)
        arrays = {"ep_return": np.zeros(E, np.float32), "ep_length": np.ones(E, np.int64),
                  "ep_success": success, "ep_task": task}
        metrics.add_segment(Segment(meta={"env_steps": E, "actor_id": "a"}, arrays=arrays), lag=0)
        np.add.at(want_n, task, 1)
        np.add.at(want_s, task, success)
    out = metrics.report(1, {}, {}, samples=1)
    names = ("PushCube-v1", "PullCube-v1", "PickCube-v1")
    assert [out[f"env/episodes/{n}"] for n in names] == want_n.tolist()
    assert sum(out[f"env/episodes/{n}"] for n in names) == out["env/episodes"]
    assert sum(out[f"env/success/{n}"] * out[f"env/episodes/{n}"] for n in names if out[f"env/episodes/{n}"]) \
        == pytest.approx(out["env/episode_success"] * out["env/episodes"])
    for i, n in enumerate(names):
        if want_n[i]:
            assert out[f"env/success/{n}"] == pytest.approx(want_s[i] / want_n[i])
    assert not any(k.startswith("env/success/") for k in Metrics(None, 10, False).report(1, {}, {}, 1))


def test_an_env_config_without_tasks_still_builds_one():
    assert EnvConfig().tasks == [] and TaskConfig().share == 1.0
