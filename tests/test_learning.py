"""Learning, end to end: demonstrations, SFT, then asynchronous RL with the full system (2 actor
processes over ZeroMQ, the ZeRO-3 learner, EMA publishing) must make the policy measurably better
than its warm start: the lower end of RL's 95 % interval above the upper end of SFT's, on the same
fixed episodes, sampled as the actors sample. And `asyncvla pipeline` caches every stage.

About 7-13 minutes on 2 cores beside a busy loop: the pixel task at 32 px with the parallel action
head (`configs/pixel_task.yaml` is 64 px with the autoregressive head), so that a learner update
takes ~0.6 s and the actors sample a whole chunk in one pass, and the critic at value_lr 3e-3. SFT
is deterministic here: 18.6 % [16.3, 21.1] on 1,024 episodes every time (17.4 % [15.2, 19.8] when
evaluations ran two torch threads). RL must land above ~23.7 % for its interval to clear that.
Measured with a busy loop on one core beside each run, from that SFT policy (the two-thread
figures; on one thread, two runs gave 32.1 and 33.9 %, RL taking ~9 minutes on a slower machine):
- 190 updates (the budget before): 27.8, 30.6, 26.1 % (the same runs' step-190 checkpoints); a
  fresh-clone CI run beside the suite's other worker gave 21.7 % and failed, its rerun 30.2 %. Mean
  27.3 %, sd 3.6: about 1.3 sd above the bar.
- 300 updates (the budget now): 41.3, 29.9, 30.6, 37.7 and 32.1 %; mean 34.3 %, sd 5.0, the lowest
  interval [27.2, 32.8] 7.4 points clear, the mean 2.3 sd above the bar. RL took 3.7-4.2 minutes.
The spread comes from the actors' timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import PIXEL
from tests.support.ports import run_port_overrides


# The settings, chosen from earlier measurements (2 cores, no busy loop), 120 s of RL from one SFT
# policy (18.8 % [15.6, 22.4] on 512 episodes) each time:
# - the config's value_lr 1e-3, 5 runs: 42.2, 30.9, 33.0, 27.0 and 31.1 %, all above SFT's interval
#   but one by 0.9 points; mean 32.8 %, sd 5.7.
# - learner.value_lr=3e-3, 5 runs: 46.1 (256 episodes), 40.6, 33.0, 36.3 and 36.7 %; mean 38.5 %,
#   sd 4.9. The critic explains little of the returns early in RL either way (EV 0.0-0.4 with 1e-3,
#   about 0 with 3e-3); perhaps the faster one follows the returns' level as the policy improves.
# - learner.lr=1e-3, 8 runs: 43.0, 37.7, 34.8, 38.5, 40.8, 30.1, 26.4 and 23.8 %; the last failed
#   the check (its interval [20.3, 27.7]). Mean 34.4 % (the config's 3e-4: 32.8 %), sd 6.9 (5.7).
# - learner.batch_trajectories=8, 3 runs: 33.2, 27.1, 29.1 %.
# - once each: value_lr=3e-3 with lr=1e-3 28.9 %, gamma=0.9 30.9 %.
# - 300 SFT steps (14.5 %) gained less; 600 (27.9 %) or policy.n_bins=8 (24.2 %) gained 11 and 4
#   points in ~100 s.
SFT_STEPS = 400         # ~45 s; the parallel head sees the target only after ~300 steps
RL_UPDATES = 300        # ~4 min beside a busy loop; a budget in updates, not seconds, so that a busy
                        # machine takes longer instead of learning less
EVAL_EPISODES = 1024    # each interval within about +-3 points; evaluations run one torch thread
                        # (actors/evaluate.py): on two, one took 15-200 s beside a busy loop
SETTINGS = ["policy.image_size=32", "policy.action_head=parallel", "learner.value_lr=3e-3",
            "eval.eval_interval=0"]     # measured without the evaluator beside training


def pipeline(out: Path, timeout: float):
    return subprocess.run(
        [sys.executable, "-m", "asyncvla.launch.cli", "pipeline", str(PIXEL),
         *SETTINGS, f"logging.output_dir={out}", "logging.experiment_name=learn", "logging.progress=false",
         f"sft.steps={SFT_STEPS}", "sft.eval_interval=0", f"sft.eval_episodes={EVAL_EPISODES}",
         "learner.max_time_s=null", f"learner.max_steps={RL_UPDATES}", "checkpoint.save_interval=1000",
         *run_port_overrides()],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="2"))   # the learner's threads; actors take one each


@pytest.mark.timeout(1800)
def test_sft_then_asynchronous_rl_beats_the_warm_start(tmp_path):
    # ~8 min beside make test's other worker. The limit only catches a hang: a busy machine takes
    # longer for the same budget in updates (over 800 s once, with more work beside a busy loop).
    r = pipeline(tmp_path, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "learn" / "summary.json").read_text())
    sft, rl = summary["sft"], summary["rl"]
    print(f"SFT {sft['success_rate']:.3f} {sft['ci95']}  RL {rl['success_rate']:.3f} {rl['ci95']} "
          f"after {rl['updates']} updates")
    assert summary["episodes"] == EVAL_EPISODES and rl["updates"] == RL_UPDATES
    assert rl["ci95"][0] > sft["ci95"][1], summary

    # A second call resumes rather than repeats: every stage is cached.
    again = pipeline(tmp_path, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for stage in ("1/3 demonstrations: cached", "2/3 SFT: cached", "3/3 RL: done"):
        assert stage in again.stdout, again.stdout[-3000:]
