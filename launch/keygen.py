"""`asyncvla keygen DIR [--clients N]`: CURVE keys for a learner and its actors.

Writes (the layout common/transport/sockets.py reads):

    DIR/server.key, DIR/server.key_secret          the learner's key pair: set transport.keys_dir=DIR
    DIR/authorized_clients/client_NNN.key          the public keys the learner accepts
    DIR/clients/client_NNN/                        one bundle per actor node: copy it there and run
        client.key, client.key_secret, server.key     `asyncvla actor --keys-dir BUNDLE ...`

Run it again on the same DIR to add clients: the server key pair is kept, new bundles are
numbered after the existing ones. To revoke a client, delete its file in authorized_clients/
and restart the learner.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import zmq
import zmq.auth

from asyncvla.common.transport.sockets import (AUTHORIZED_DIR, CLIENT_KEY, CLIENT_SECRET, CLIENTS_DIR, SERVER_KEY,
                                     SERVER_SECRET)


def add_parser(sub) -> None:
    p = sub.add_parser("keygen", help="write CURVE keys for encrypted, authenticated transport",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="keys directory (created if missing)")
    p.add_argument("--clients", type=int, default=1, help="actor key bundles to add (default 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.clients < 0:
        print(f"asyncvla keygen: --clients={args.clients} must be >= 0", file=sys.stderr)
        return 2
    if not zmq.has("curve"):
        print("asyncvla keygen: this libzmq was built without CURVE support", file=sys.stderr)
        return 2
    bundles = generate(args.dir, args.clients)
    root = Path(args.dir)
    print(f"learner: transport.keys_dir={root}")
    for b in bundles:
        print(f"actor:   asyncvla actor --keys-dir {b} ...   (copy {b} to the actor's node)")
    return 0


def generate(keys_dir: str | os.PathLike, num_clients: int) -> list[Path]:
    """Create (or keep) the server key pair and add `num_clients` client bundles; returns them."""
    root = Path(keys_dir)
    authorized, clients = root / AUTHORIZED_DIR, root / CLIENTS_DIR
    for d in (root, authorized, clients):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    if not (root / SERVER_SECRET).is_file():
        zmq.auth.create_certificates(root, "server")
        os.chmod(root / SERVER_SECRET, 0o600)
    start = len([p for p in clients.iterdir() if p.name.startswith("client_")])
    bundles = []
    for i in range(start, start + num_clients):
        name = f"client_{i:03d}"
        bundle = clients / name
        bundle.mkdir(mode=0o700)
        zmq.auth.create_certificates(bundle, "client")
        os.chmod(bundle / CLIENT_SECRET, 0o600)
        shutil.copyfile(root / SERVER_KEY, bundle / SERVER_KEY)
        shutil.copyfile(bundle / CLIENT_KEY, authorized / f"{name}.key")
        bundles.append(bundle)
    return bundles
