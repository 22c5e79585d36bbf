"""`asyncvla actor --learner tcp://HOST:PORT`: a standalone actor node.

It needs no config: the learner's welcome carries the config, the policy (a path readable here,
or its files shipped once), the env spec, the segment endpoints and the current weights.
Start any number, on any host, at any time; stop them at any time.

Until the learner answers, the actor keeps saying hello; after 5 s without an answer it warns
what to check (is the learner there; does it use CURVE keys, so that this actor needs
--keys-dir), and again every 30 s. With --join-timeout it gives up instead (exit code 1).

Without CURVE keys a learner admits only holders of its run's join secret (RUN/join_secret,
readable by the run's owner only): on the learner's machine, pass --run-dir RUN (or set
ASYNCVLA_JOIN_SECRET, as `asyncvla train` does for the actors it starts). Refused, the actor
exits 1 with one line saying so.
"""

from __future__ import annotations

import argparse
import logging


def add_parser(sub) -> None:
    p = sub.add_parser("actor", help="run an actor node that joins a learner over the network",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learner", required=True, metavar="tcp://HOST:PORT",
                   help="the learner's control endpoint (transport.control_port on learner rank 0)")
    p.add_argument("--num-envs", type=int, help="environments in this actor (default: the learner's actor.num_envs)")
    p.add_argument("--device", help="torch device for this actor's policy copy (default: the learner's actor.device)")
    p.add_argument("--actor-id", help="name shown in the learner's registry (default: HOST-PID)")
    p.add_argument("--actor-index", type=int, default=None,
                   help="seeds this actor's envs apart from the others (default: derived from the id)")
    p.add_argument("--keys-dir", help="CURVE keys made by `asyncvla keygen` (client side)")
    p.add_argument("--run-dir", metavar="RUN", help="the learner's run directory on this machine: its join "
                                                    "secret (RUN/join_secret) lets this actor join a learner "
                                                    "without CURVE keys")
    p.add_argument("--max-segments", type=int, help="stop after sending this many segments")
    p.add_argument("--join-timeout", type=float, metavar="SECONDS",
                   help="give up (exit code 1) when the learner has not welcomed this actor within "
                        "SECONDS (default: keep trying, warning every 30 s)")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.actors.main import run as run_actor
    from asyncvla.common.transport.auth import join_secret_from_env, read_join_secret
    from asyncvla.common.config import TransportConfig
    from asyncvla.common.transport.sockets import TransportError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(levelname)s %(message)s")
    for flag, value in (("--num-envs", args.num_envs), ("--join-timeout", args.join_timeout)):
        if value is not None and value <= 0:
            raise SystemExit(f"asyncvla actor: {flag}={value} must be > 0")
    tcfg = TransportConfig(keys_dir=args.keys_dir)
    try:
        secret = read_join_secret(args.run_dir) if args.run_dir else join_secret_from_env()
    except ValueError as e:
        raise SystemExit(f"asyncvla actor: --run-dir: {e}")
    try:
        return run_actor(args.learner, actor_id=args.actor_id, num_envs=args.num_envs, device=args.device,
                         max_segments=args.max_segments, actor_index=args.actor_index, tcfg=tcfg,
                         join_timeout=args.join_timeout, join_secret=secret)
    except TransportError as e:             # phrased for the user: no traceback
        raise SystemExit(f"asyncvla actor: {e}")
