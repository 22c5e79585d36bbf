"""`asyncvla sft CONFIG sft.data=DEMO_DIR [key=value ...]`: supervised fine-tuning on demonstrations.

Trains the policy of CONFIG on the demos (ManiSkill's trajectory format, e.g. from `asyncvla
collect`, or a LeRobot dataset v2.1/v3.0, mapped by sft.lerobot.*) with the RL learner's DeepSpeed
engine (its ZeRO stage, or sft.zero_stage): action-token cross-entropy plus a critic warm-up on the
demos' discounted returns (learner/sft.py). It writes RUN/sft/: tb/ (sft/* metrics),
checkpoints/ (a rerun continues from the latest complete one), eval/step_N/summary.json (success
sampled as actors sample, on fixed initial states), summary.json and policy/, the fine-tuned policy
for `asyncvla train CONFIG policy.pretrained_path=RUN/sft/policy`, `asyncvla eval` and `asyncvla
export`. RUN is logging.output_dir/logging.experiment_name. It runs in this process as one rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on demonstrations (the warm start before RL)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides; sft.data=DIR names the demos")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.common.config import ConfigError, load_config, parse_overrides

    try:
        cfg = load_config(args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(f"asyncvla sft: config error: {e}", file=sys.stderr)
        return 2
    return sft(cfg)


def sft(cfg) -> int:
    """Run SFT for `cfg` and print where the policy went; 2 on a bad config or demo file."""
    from asyncvla.common.config import ConfigError
    from asyncvla.common.data.demos import DemoError
    from asyncvla.learner import sft as sft_loop

    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s sft %(levelname)s %(message)s")
    from asyncvla.common import trackers
    found = trackers.problems(cfg)            # (before minutes of start-up, not after)
    for line in found:
        print(f"asyncvla sft: cannot start: {line}", file=sys.stderr)
    if found:
        return 2
    if not cfg.sft.data:
        print("asyncvla sft: config error: sft.data is not set; give the demonstrations, e.g. "
              "sft.data=demos/ (made by `asyncvla collect`)", file=sys.stderr)
        return 2
    try:
        policy_dir = sft_loop.run(cfg, evaluate=evaluator(cfg), default_instruction=default_instruction(cfg),
                                  progress=cfg.logging.progress)
    except (ConfigError, DemoError) as e:
        print(f"asyncvla sft: {e}", file=sys.stderr)
        return 2
    finally:
        from asyncvla.learner.engine import close_distributed
        close_distributed()
    print(f"asyncvla sft: policy written to {policy_dir}")
    return 0


def evaluator(cfg):
    """evaluate(policy, step): success of the policy sampled as actors sample, on the fixed initial
    states of eval (the summary also goes to RUN/sft/eval/step_N/summary.json)."""
    from asyncvla.actors.evaluate import periodic_eval
    from asyncvla.learner.sft import sft_dir

    eval_cfg = dataclasses.replace(cfg, eval=dataclasses.replace(
        cfg.eval, num_episodes=cfg.sft.eval_episodes, greedy=False, save_video=False))

    def evaluate(policy, step):
        return periodic_eval(policy, eval_cfg, step, sft_dir(cfg))
    return evaluate


def default_instruction(cfg):
    """The instruction for demo episodes that carry none (e.g. files made by ManiSkill's tools)."""
    from asyncvla.actors.envs.instructions import instruction_for
    try:
        return instruction_for(cfg.env.id, cfg.env.instruction)
    except ValueError:
        return cfg.env.instruction

