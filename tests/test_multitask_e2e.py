"""Several tasks in one run, end to end on the real simulator (configs/multitask.yaml, small):
scripted demos of each task with its own instruction, then `asyncvla train` with 2 ZeRO-3 learner
ranks and an actor process whose envs hold different tasks, success logged per task, and
`asyncvla eval` of each task alone, each told another task's sentence (--instruction-set swapped).

This checks the mechanics, not learning (a few updates of a random policy)."""

import json
import subprocess
import sys

import pytest

from asyncvla.actors.collect import collect_demos
from asyncvla.actors.envs.tasks import instructions_in, tasks_of
from asyncvla.common.config import load_config
from tests.support.paths import REPO
from tests.support.ports import run_port_overrides
from tests.support.runs import scalars

MULTITASK = REPO / "configs" / "multitask.yaml"
TASKS = ("PushCube-v1", "PullCube-v1", "PickCube-v1")


def test_collection_records_each_tasks_share_with_its_instruction():
    cfg = load_config(MULTITASK, ["collect.action_noise=0.0"])
    episodes, stats = collect_demos(cfg, num_episodes=4, action_noise=0.0, seed=3, num_envs=1)
    # one env per task at least (num_envs=1 asked for fewer), and the episodes dealt by share: 2, 1, 1
    by_task = [sum(ep.instruction == t.instruction for ep in episodes) for t in tasks_of(cfg.env)]
    assert by_task == [2, 1, 1] and stats["kept"] == 4, (by_task, stats)
    assert all(ep.success[-1] and ep.states["agent/state"].shape[1] == 29 for ep in episodes)   # env.state_keys


@pytest.mark.timeout(900)
def test_train_on_a_mix_of_tasks_logs_each_and_evaluates_each(tmp_path):
    overrides = [f"logging.output_dir={tmp_path}", "logging.experiment_name=mt", "logging.progress=false",
                 "launch.num_learner_ranks=2", "launch.num_local_actors=1", "actor.num_envs=3",
                 "actor.rollout_length=8", "env.max_episode_steps=8", "learner.max_steps=2",
                 "learner.max_time_s=null", "learner.batch_trajectories=6", "learner.critic_warmup_steps=0",
                 "checkpoint.save_interval=2", "eval.eval_interval=0", *run_port_overrides()]
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", str(MULTITASK), *overrides],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "mt"
    # one actor's 3 envs dealt out over the 3 tasks, so every segment (a rank's whole share of an
    # update) holds each task's episodes (one every 2 policy steps): they reach the learner, counted
    # apart, adding up to the total
    episodes = {t: sum(scalars(run, f"env/episodes/{t}").values()) for t in TASKS}
    assert all(n > 0 for n in episodes.values()), episodes
    assert sum(episodes.values()) == sum(scalars(run, "env/episodes").values())
    assert set(scalars(run, "env/success/PickCube-v1")) <= set(scalars(run, "env/episodes/PickCube-v1"))

    cfg = load_config(MULTITASK)
    for words in ("swapped",):       # (the held-out phrasings: tests/test_tasks.py; train: every eval test)
        out = tmp_path / f"eval_{words}.json"
        e = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "eval", str(run), "--episodes", "1",
                            "--num-envs", "1", "--instruction-set", words, "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert e.returncode == 0, e.stdout[-2000:] + e.stderr[-2000:]
        summary = json.loads(out.read_text())
        assert list(summary["tasks"]) == list(TASKS) and summary["num_episodes"] == 3
        told = [ep["instruction"] for ep in summary["episodes"]]
        assert told == instructions_in(tasks_of(cfg.env), words), (words, told)
        assert all(f"{t} " in e.stdout for t in TASKS)           # a line per task, then the pooled one
