"""The `asyncvla` command. Each subcommand lives in its own module and registers itself here.

A subcommand module exposes `add_parser(subparsers)`, which adds its parser and sets
`func(args) -> int` as the default handler.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `asyncvla --help` lists them.
SUBCOMMANDS = [
    "asyncvla.launch.collect_cmd",
    "asyncvla.launch.convert_cmd",
    "asyncvla.launch.sft_cmd",
    "asyncvla.launch.train",
    "asyncvla.launch.pipeline",
    "asyncvla.launch.actor_cmd",
    "asyncvla.launch.fleet",
    "asyncvla.launch.actor_host",
    "asyncvla.launch.eval_cmd",
    "asyncvla.launch.export_cmd",
    "asyncvla.launch.config_cmd",
    "asyncvla.launch.keygen",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncvla",
        description="Asynchronous actor-learner RL for vision-language-action policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; key=value overrides may also follow options (`asyncvla train
    CONFIG --hostfile H learner.max_steps=9`), which argparse alone refuses after an option."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:     # Ctrl-C where a command has no stop of its own (start-up, SFT, eval)
        print(f"asyncvla {args.command}: interrupted", file=sys.stderr, flush=True)
        return 128 + 2            # (SIGINT, as a shell reports it)


if __name__ == "__main__":
    sys.exit(main())
