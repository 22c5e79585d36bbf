"""Wall time of an evaluation (`asyncvla eval`, the SFT and pipeline summaries) by `eval.num_envs`.

configs/maniskill.yaml's env and policy (PushCube-v1 from RGB, CPU physics, software renderer),
the policy at its random init, actions sampled. Each ManiSkill CPU env is a worker process that
starts in ~15 s of a core (imports and the renderer's pipelines), and on 2 cores more envs do not
step faster, so fewer envs finish sooner. A random policy never succeeds: every episode runs to
env.max_episode_steps, so this measures start-up and stepping, not the rounds a competent policy
leaves part-idle (each round waits for its longest episode).

    python -m tests.benchmarks.eval_throughput [--quick] [--out bench_results/eval_throughput.json]
"""

from __future__ import annotations

import sys

from asyncvla.actors.evaluate import evaluate_policy, one_torch_thread
from asyncvla.common.config import load_config
from asyncvla.common.policy import VLAPolicy
from tests.benchmarks.report import Figure, main
from tests.support.paths import REPO

NUM_ENVS = (2, 4, 8)


def run(quick: bool = False) -> dict:
    cfg = load_config(REPO / "configs" / "maniskill.yaml", ["env.max_episode_steps=40"])
    policy = VLAPolicy.build(cfg.policy)
    episodes = 8 if quick else 16
    rows = []
    for num_envs in NUM_ENVS:
        with one_torch_thread():                 # as the SFT and pipeline evaluations run
            s = evaluate_policy(policy, cfg.env, cfg.policy, episodes, greedy=False, seed=0, num_envs=num_envs)
        rows.append({"num_envs": num_envs, "episodes": episodes, "env_steps": int(sum(e["length"] for e in s["episodes"])),
                     "seconds": s["eval_s"], "s_per_episode": round(s["eval_s"] / episodes, 2)})
    return {"env_id": cfg.env.id, "max_episode_steps": cfg.env.max_episode_steps, "rows": rows}


def figures(results: dict) -> list[Figure]:
    return [Figure("eval throughput", f"{results['env_id']} evaluation, {r['num_envs']} envs", r["seconds"], "s",
                   note=f"{r['episodes']} episodes, {r['env_steps']} env steps, {r['s_per_episode']:.2f} s per episode")
            for r in results["rows"]]


if __name__ == "__main__":
    main(sys.modules[__name__])
