"""`asyncvla actor-host`: one host's actors, as `asyncvla actors` (launch/fleet.py) starts them over ssh.

It reads one JSON line from stdin first ({"keys": {file name: text}}: this host's CURVE client
bundle, or none; "join_secret": the run's, for a learner without keys, handed to the actors in
their environment), writes the keys to RUN/actors/HOST/keys (0700 folder, 0600 files), starts
--actors `asyncvla actor` processes (ids HOST-<i>, env seeds from --first-index), pinned to
--placement, each logging to RUN/actors/HOST/actor_<i>.log, and restarts one that exits non-zero
up to --max-restarts times. It prints one "actor-host:" line whenever its fleet changes.

It stops its actors (SIGTERM, then SIGKILL after 10 s), deletes the keys and exits when its stdin
closes (the launcher's stop, or its ssh connection gone), when its parent changes (sshd ended),
on SIGINT/SIGTERM, or when every actor has ended (the learner's "shutdown": exit 0).

Started by srun or by hand instead (launch/slurm/asyncvla.sbatch): --no-stdin (no keys line, and
only signals stop it) and --keys-dir BUNDLE (a client bundle on a shared filesystem, used in
place and kept); its actors then take a join secret from their environment (ASYNCVLA_JOIN_SECRET).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from asyncvla.common import placement
from asyncvla.common.transport.auth import JOIN_SECRET_ENV
from asyncvla.common.signals import die_with_parent

ACTOR_STOP_GRACE_S = 10.0


def add_parser(sub) -> None:
    p = sub.add_parser("actor-host", help="one host's actors (started by `asyncvla actors` over ssh)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learner", required=True, metavar="tcp://HOST:PORT")
    p.add_argument("--host", required=True, help="this host's name in the hostfile (actor ids, log folder)")
    p.add_argument("--actors", type=int, required=True)
    p.add_argument("--first-index", type=int, default=0)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--placement", default="all")
    p.add_argument("--keys-dir", help="a client key bundle to use in place (with --no-stdin)")
    p.add_argument("--no-stdin", action="store_true",
                   help="not started by `asyncvla actors`: read no keys from stdin, stop on signals only")
    p.set_defaults(func=run)


def run(args) -> int:
    folder = Path(args.run_dir) / "actors" / args.host
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        first = {} if args.no_stdin else json.loads(sys.stdin.readline() or "{}")
        folder.mkdir(parents=True, exist_ok=True)
        keys = write_keys(folder / "keys", first.get("keys") or {})
        if args.keys_dir:
            if keys is not None:
                raise ValueError("--keys-dir and keys on stdin: give one")
            given = Path(args.keys_dir)
            if not (given / "client.key_secret").is_file():
                raise ValueError(f"--keys-dir {given} holds no client.key_secret (an `asyncvla keygen` bundle)")
        cores = placement.parse_cores(args.placement, placement.available_cores(), "launch.placement.actors")
    except (ValueError, OSError) as e:
        say(f"cannot start: {type(e).__name__}: {e}")
        return 2
    if not args.no_stdin:
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    parent = None if args.no_stdin else os.getppid()
    supervisor = Supervisor(args, folder, keys or (Path(args.keys_dir) if args.keys_dir else None),
                            cores if args.placement.strip() != "all" else None, first.get("join_secret"))
    try:
        supervisor.start_all()
        while not stop.wait(0.5):
            if parent is not None and os.getppid() != parent:
                stop.set()
            elif not supervisor.check():
                break
    finally:
        supervisor.stop_all()
        if keys is not None:
            shutil.rmtree(keys, ignore_errors=True)
    failed = [i for i, code in supervisor.codes.items() if code != 0]
    say(f"stopped; {supervisor.summary()}")
    return 0 if stop.is_set() or not failed else 1


def say(text: str) -> None:
    try:
        print(f"actor-host: {text}", flush=True)
    except BrokenPipeError:        # the launcher is gone: nothing to tell
        pass


def write_keys(folder: Path, files: dict[str, str]) -> Path | None:
    """This host's client bundle, readable by this user only; None without keys."""
    if not files:
        return None
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for name, text in files.items():
        if Path(name).name != name or name.startswith("."):
            raise ValueError(f"key file name {name!r}")
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
    return folder


def _watch_stdin(stop: threading.Event) -> None:
    """The launcher closes our stdin to stop us (and ssh closes it when the connection drops)."""
    try:
        while sys.stdin.readline():
            pass
    except (OSError, ValueError):
        pass
    stop.set()


class Supervisor:
    """This host's actor processes, restarted when they crash."""

    def __init__(self, args, folder: Path, keys: Path | None, cores: list[int] | None,
                 join_secret: str | None = None):
        self.args, self.folder, self.keys, self.cores = args, folder, keys, cores
        self.join_secret = join_secret
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, int] = {}
        self.codes: dict[int, int] = {}           # actors that ended for good, and how

    def command(self, i: int) -> list[str]:
        index = self.args.first_index + i
        cmd = [sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", self.args.learner,
               "--actor-id", f"{self.args.host}-{i}", "--actor-index", str(index)]
        return cmd + (["--keys-dir", str(self.keys)] if self.keys else [])

    def start(self, i: int) -> None:
        me = os.getpid()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.join_secret:            # (in the environment: a command line is visible to every user)
            env[JOIN_SECRET_ENV] = self.join_secret
        if self.cores is not None:
            env[placement.CORES_ENV] = ",".join(map(str, self.cores))
        with open(self.folder / f"actor_{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(self.command(i), stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, preexec_fn=lambda: die_with_parent(me))

    def start_all(self) -> None:
        for i in range(self.args.actors):
            self.restarts[i] = 0
            self.start(i)
        say(f"{self.summary()}; logs in {self.folder}")

    def check(self) -> bool:
        """Restart crashed actors; False when none is left."""
        for i, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if code != 0 and self.restarts[i] < self.args.max_restarts:
                self.restarts[i] += 1
                self.start(i)
                say(f"actor {self.args.host}-{i} exited with {code}; restart {self.restarts[i]}/"
                    f"{self.args.max_restarts}; {self.summary()}")
                continue
            del self.procs[i]
            self.codes[i] = code
            say(f"actor {self.args.host}-{i} ended with exit code {code}; {self.summary()}")
        return bool(self.procs)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.time() + ACTOR_STOP_GRACE_S
        while time.time() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.1)
        for i, proc in self.procs.items():
            _signal_group(proc.pid, signal.SIGKILL)
            self.codes.setdefault(i, proc.wait())
        self.procs = {}

    def summary(self) -> str:
        return (f"{len(self.procs)}/{self.args.actors} actors running, {sum(self.restarts.values())} restarts, "
                f"{len(self.codes)} ended")


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
