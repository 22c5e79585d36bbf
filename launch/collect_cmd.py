"""`asyncvla collect CONFIG --episodes N --out DIR`: record demonstrations for supervised fine-tuning.

A scripted demonstrator acts in `env.id` (PixelReach-v0: the oracle that heads straight for the
target), with `collect.action_noise` of its steps replaced by random actions while its own action
stays the label. Only successful episodes are kept. The output is ManiSkill's trajectory format,
DIR/trajectory.h5 + DIR/trajectory.json, with images at the policy's size (policy.image_size), the
instruction of each episode and its seed; `asyncvla sft CONFIG sft.data=DIR` reads it.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("collect", help="record demonstrations (ManiSkill trajectory format) for SFT",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. collect.action_noise=0.2")
    p.add_argument("--episodes", type=int, help="successful episodes to keep (collect.num_episodes)")
    p.add_argument("--noise", type=float, help="share of random executed actions (collect.action_noise)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.common.config import ConfigError, load_config, parse_overrides

    overrides = parse_overrides(args.overrides)
    if args.episodes is not None:
        overrides.append(f"collect.num_episodes={args.episodes}")
    if args.noise is not None:
        overrides.append(f"collect.action_noise={args.noise}")
    try:
        cfg = load_config(args.config, overrides)
        stats = collect(cfg, args.out)
    except (ConfigError, ValueError) as e:
        print(f"asyncvla collect: {e}", file=sys.stderr)
        return 2
    print(f"asyncvla collect: {stats['attempted']} episodes attempted, {stats['solved']} solved, "
          f"{stats['kept']} kept ({stats['steps']} steps) -> {args.out}")
    return 0


def collect(cfg, out_dir) -> dict:
    """Record cfg.collect.num_episodes demonstrations into out_dir; returns the counts."""
    from tqdm import tqdm

    from asyncvla.actors.collect import collect_demos, env_info
    from asyncvla.common.demos import write_demos

    c = cfg.collect
    with tqdm(total=c.num_episodes, desc="collect", unit="episode", dynamic_ncols=True) as bar:
        episodes, stats = collect_demos(cfg, c.num_episodes, c.action_noise, c.seed, c.num_envs,
                                        progress=bar.update)
    write_demos(out_dir, episodes, env_info(cfg), camera=cfg.env.camera, source_type="scripted",
                source_desc=f"scripted demonstrator of {cfg.env.id}, action_noise={c.action_noise}")
    return stats
