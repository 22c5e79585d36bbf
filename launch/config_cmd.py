"""`asyncvla config`: validate a config and print it resolved, or print the configuration reference."""

from __future__ import annotations

import sys

from asyncvla.common.config import ConfigError, describe, load_config, parse_overrides, to_yaml


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="validate a config file (+ overrides) and print it resolved",
                       description="Validate CONFIG with dotted overrides (key=value) and print the "
                                   "resolved configuration; --describe prints every key with its "
                                   "default, allowed values and meaning (with --markdown: as the page "
                                   "docs/configuration.md).")
    p.add_argument("config", nargs="?", help="YAML file in the schema of common/config/")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.num_envs=4")
    p.add_argument("--describe", action="store_true", help="print the configuration reference")
    p.add_argument("--markdown", action="store_true",
                   help="with --describe: one markdown table per section (docs/configuration.md)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.markdown and not args.describe:
        print("asyncvla: config error: --markdown goes with --describe", file=sys.stderr)
        return 2
    if args.describe:
        print(describe(markdown=args.markdown), end="\n" if not args.markdown else "")
        return 0
    try:
        config = load_config(args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(f"asyncvla: config error: {e}", file=sys.stderr)
        return 2
    from asyncvla.launch import preflight
    found = preflight.problems(config, ports=False)
    for line in found:
        print(f"asyncvla: config error: {line}", file=sys.stderr)
    if found:
        return 2
    print(to_yaml(config), end="")
    for line in preflight.busy_ports(config):     # free or not right now: a note, not an error
        print(f"asyncvla: note: {line}", file=sys.stderr)
    return 0
