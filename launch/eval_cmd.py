"""`asyncvla eval CHECKPOINT_OR_EXPORT`: success rate, return and episode length of a policy.

The policy comes from a training checkpoint (a run directory, its checkpoints/ folder or one
checkpoint folder; the learner's consolidated weights, or with --weights ema the published ones)
or from a directory written by `asyncvla export` (or any VLAPolicy.save_pretrained folder, e.g. a
run's policy_init/). The env is the one of the run's config unless --env names another (an export
without config.yaml needs --env). Episodes start from fixed initial states: the same --seed,
--episodes and --num-envs give the same starts to every policy. Prints the means with 95%
confidence intervals (Wilson for the success rate), writes the JSON summary to --out (default:
VIDEO_DIR/summary.json with --video) and, with --video, one mp4 per episode.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint or an exported policy (success rate, videos)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="CHECKPOINT_OR_EXPORT", help="run dir, checkpoint dir or export dir")
    p.add_argument("--env", metavar="ID", help="one env id (default: the run's env.id, or each of its env.tasks)")
    p.add_argument("--episodes", type=int, help="episodes to run, of each task (default: the run's "
                                                 "eval.num_episodes)")
    p.add_argument("--num-envs", type=int,
                   help="envs stepped together (default: the run's eval.num_envs, at most --episodes)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="greedy", action="store_true", default=None,
                      help="take the most likely action tokens (default: the run's eval.greedy)")
    mode.add_argument("--sample", dest="greedy", action="store_false", help="sample the action tokens")
    p.add_argument("--temperature", type=float, help="sample at this temperature (default: the policy's "
                   "policy.temperature, as its actors sampled)")
    p.add_argument("--seed", type=int, help="seed of the initial states (default: the run's env.seed)")
    p.add_argument("--weights", choices=["trained", "ema"], default="trained",
                   help="of a checkpoint: the learner's weights (default) or the published EMA ones")
    p.add_argument("--instruction-set", choices=["train", "eval", "swapped"], default="train",
                   help="what each task's envs tell the policy: its training sentence, its held-out "
                        "phrasing (eval), or the next task's sentence (swapped: a control; env.tasks)")
    p.add_argument("--video", metavar="DIR", help="write one mp4 per episode here")
    p.add_argument("--out", metavar="JSON", help="write the summary here")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    import torch

    from asyncvla.actors.evaluate import evaluate_policy, format_summary, write_summary
    from asyncvla.common.config import Config, ConfigError, EnvConfig
    from asyncvla.learner.export import load_policy

    try:
        for flag in ("episodes", "num_envs"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
        if args.temperature is not None and not args.temperature > 0:
            raise ConfigError(f"--temperature={args.temperature} must be > 0")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        policy, cfg, source = load_policy(args.path, args.weights, device)
        if args.temperature is not None:           # (only how this evaluation samples)
            policy.cfg = dataclasses.replace(policy.cfg, temperature=args.temperature)
        if cfg is None:
            if not args.env:
                raise ConfigError(f"'{args.path}' holds no config.yaml to take the env from; give --env ID")
            cfg = Config(env=EnvConfig(id=args.env))
        env_cfg = dataclasses.replace(cfg.env, id=args.env, tasks=[]) if args.env else cfg.env
        where = source["path"] + (f" (step {source['step']}, {source['weights']} weights)"
                                  if source["kind"] == "checkpoint" else "")
        print(f"policy: {where}", flush=True)
        summary = evaluate_policy(
            policy, env_cfg, policy.cfg, args.episodes or cfg.eval.num_episodes,
            greedy=cfg.eval.greedy if args.greedy is None else args.greedy,
            seed=cfg.env.seed if args.seed is None else args.seed, video_dir=args.video,
            num_envs=args.num_envs or cfg.eval.num_envs, instruction_set=args.instruction_set)
    except (ConfigError, OSError, ValueError) as e:
        print(f"asyncvla eval: {e}", file=sys.stderr)
        return 2
    summary["policy"] = source
    print(format_summary(summary))
    out = args.out or (f"{args.video}/summary.json" if args.video else None)
    if out:
        write_summary(out, summary)
        print(f"summary: {out}" + (f"; videos: {args.video}" if args.video else ""))
    return 0
