"""`asyncvla actors --hostfile HOSTS --learner tcp://HOST:PORT`: actor fleets on many hosts.

    asyncvla actors --hostfile actor_hosts --learner tcp://learner-0:5555 [--per-host 16] [--keys-dir KEYS]
    asyncvla train CONFIG ... --actor-hostfile actor_hosts       (the learner and its fleets together)

The hostfile has deepspeed's format, one host per line, "HOST slots=N": N actors on HOST
(--per-host overrides every N). Each host gets one `ssh HOST` that runs `asyncvla actor-host`
(launch/actor_host.py) in this checkout's path with this venv's python, as the deepspeed launcher
reaches learner nodes: `ssh HOST` must work without a prompt, and every host needs the same
checkout and venv at the same path. Variables for the remote processes go in .deepspeed_env
(in the current folder or $HOME, or the file named by $DS_ENV_FILE), as for learner ranks.

There, a supervisor starts the N actors, pins them with launch.placement.actors (--placement),
restarts a crashed one up to --max-restarts times, writes each actor's log to
RUN/actors/HOST/actor_<i>.log on that host, and prints one summary line when its fleet changes;
here each line comes prefixed with its host. One ssh per host (not pdsh, which drops stdin): its
stdin carries the host's CURVE keys and, closed, the stop.

Keys: with --keys-dir (the learner's `asyncvla keygen` folder, transport.keys_dir) host i gets
client bundle i (KEYS/clients/client_00i) through its ssh channel; the supervisor writes it to
RUN/actors/HOST/keys (folder 0700, files 0600) and deletes it when it stops. Without keys the
transport is plain TCP: use it only on a network you trust (README: Scaling out), and the learner
admits only holders of its run's join secret: `asyncvla train` sends it down each channel, and a
fleet started by hand takes $ASYNCVLA_JOIN_SECRET or RUN_DIR/join_secret (--run-dir the learner's
run directory).

Stopping: Ctrl-C (or SIGTERM) closes every host's channel; each supervisor stops its actors
(SIGTERM, SIGKILL after 10 s) and exits, and a host whose ssh has not ended after 15 s is cut off.
A host that cannot be reached is named in one line; the others go on. A supervisor whose ssh
connection drops stops its actors as well (it watches its stdin and its parent).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from asyncvla.common.signals import die_with_parent

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
               "-o", "ServerAliveCountMax=3"]
UNREACHABLE = 255                  # ssh's exit code when it could not connect
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class Host:
    name: str
    actors: int
    first_index: int               # actor indices (env seeds) first_index .. first_index + actors - 1


class HostfileError(ValueError):
    pass


def read_hostfile(path: str | os.PathLike, per_host: int | None = None) -> list[Host]:
    """Hosts of a deepspeed-style hostfile ("HOST slots=N", # comments); per_host overrides N."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostfileError(f"cannot read the actor hostfile {path}: {e.strerror or e}") from None
    hosts, index = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?", line)
        if m is None:
            raise HostfileError(f"{path}:{number}: {line!r} is not 'HOST slots=N'")
        count = per_host if per_host is not None else int(m.group(2) or 1)
        if count < 1:
            raise HostfileError(f"{path}:{number}: slots={count}: a host needs at least 1 actor")
        if any(h.name == m.group(1) for h in hosts):
            raise HostfileError(f"{path}:{number}: host {m.group(1)} is listed twice")
        hosts.append(Host(m.group(1), count, index))
        index += count
    if not hosts:
        raise HostfileError(f"the actor hostfile {path} names no host")
    return hosts


def client_bundles(keys_dir: str | os.PathLike, needed: int, make_missing: bool = False) -> list[Path]:
    """The first `needed` client bundles of an `asyncvla keygen` folder, one per host; with
    `make_missing`, those lacking are made (only before the learner starts: it reads its authorized
    clients once)."""
    from asyncvla.common.transport.sockets import CLIENTS_DIR
    bundles = sorted(p for p in (Path(keys_dir) / CLIENTS_DIR).glob("client_*") if p.is_dir())
    missing = needed - len(bundles)
    if make_missing and missing > 0:
        from asyncvla.launch.keygen import generate
        bundles += generate(keys_dir, missing)
        print(f"asyncvla: made {missing} client key bundles in {Path(keys_dir) / CLIENTS_DIR} for the actor hosts",
              flush=True)
    if len(bundles) < needed:
        raise HostfileError(f"{needed} actor hosts need {needed} client key bundles, {keys_dir}/{CLIENTS_DIR} has "
                            f"{len(bundles)}: run `asyncvla keygen {keys_dir} --clients {needed - len(bundles)}` "
                            "(then restart the learner, which reads its authorized clients at start)")
    return bundles[:needed]


def remote_env() -> dict[str, str]:
    """KEY=VALUE lines of the deepspeed env file(s): $HOME's, then the current folder's."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    env = {}
    for folder in (Path.home(), Path.cwd()):
        path = folder / name if not os.path.isabs(name) else Path(name)
        if path.is_file():
            for line in path.read_text().splitlines():
                key, sep, value = line.strip().partition("=")
                if sep and key and not key.startswith("#"):
                    env[key] = value
    return env


def host_command(host: Host, learner: str, run_dir: Path, max_restarts: int, placement: str,
                 env: dict[str, str]) -> str:
    """The shell command ssh runs on `host`."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in {**env, "PYTHONUNBUFFERED": "1"}.items())
    cli = [sys.executable, "-m", "asyncvla.launch.cli", "actor-host", "--learner", learner, "--host", host.name,
           "--actors", str(host.actors), "--first-index", str(host.first_index), "--run-dir", str(run_dir),
           "--max-restarts", str(max_restarts), "--placement", placement]
    return f"{exports}cd {shlex.quote(os.getcwd())} && exec {shlex.join(cli)}"


class Fleet:
    """One ssh per host running its supervisor; their lines relayed here with the host's name."""

    def __init__(self, hosts: list[Host], learner: str, run_dir: Path, keys_dir: str | None = None,
                 max_restarts: int = 5, placement: str = "all", out=None, make_missing_keys: bool = False,
                 join_secret: str | None = None):
        self.hosts, self.out, self.join_secret = hosts, out or sys.stdout, join_secret
        bundles = client_bundles(keys_dir, len(hosts), make_missing_keys) if keys_dir else [None] * len(hosts)
        self.keys = {h.name: _bundle_files(b) for h, b in zip(hosts, bundles)}
        env = remote_env()
        self.commands = {h.name: host_command(h, learner, run_dir, max_restarts, placement, env) for h in hosts}
        self.procs: dict[str, subprocess.Popen] = {}
        self.heard: dict[str, bool] = {}           # a supervisor line came: the host was reached
        self.last_line: dict[str, str] = {}
        self.ended: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        me = os.getpid()
        for h in self.hosts:
            proc = subprocess.Popen(["ssh", *SSH_OPTIONS, h.name, self.commands[h.name]], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=lambda: die_with_parent(me))
            self.procs[h.name], self.heard[h.name] = proc, False
            first = {"keys": self.keys[h.name], **({"join_secret": self.join_secret} if self.join_secret else {})}
            try:            # the first line the supervisor reads: this host's keys (or none), the join secret
                proc.stdin.write((json.dumps(first) + "\n").encode())
                proc.stdin.flush()
            except OSError:
                pass        # (ssh already gone: poll() names the host)
            t = threading.Thread(target=self._relay, args=(h.name, proc), daemon=True)
            t.start()
            self._threads.append(t)
        self.say(f"starting {sum(h.actors for h in self.hosts)} actors on {len(self.hosts)} hosts over ssh")

    def say(self, text: str) -> None:
        with self._lock:
            print(f"asyncvla actors: {text}", file=self.out, flush=True)

    def _relay(self, host: str, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            self.last_line[host] = line
            if line.startswith("actor-host:"):
                self.heard[host] = True
                self.say(f"{host}: {line.split(':', 1)[1].strip()}")
            elif self.heard[host]:
                self.say(f"{host}: {line}")

    def poll(self) -> int:
        """Name each host whose ssh ended since the last call; the hosts still running."""
        for host, proc in self.procs.items():
            code = proc.poll()
            if code is None or host in self.ended:
                continue
            self.ended[host] = code
            for t in self._threads:
                t.join(timeout=0.2)
            if code == UNREACHABLE and not self.heard[host]:
                self.say(f"{host}: cannot be reached ({self.last_line.get(host, 'ssh exit 255')}); "
                         "the other hosts go on")
            elif code != 0:
                self.say(f"{host}: its supervisor ended with exit code {code} "
                         f"({self.last_line.get(host, 'no output')})")
        return sum(1 for p in self.procs.values() if p.poll() is None)

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while self.poll() and time.time() < deadline:
            time.sleep(0.2)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Close every host's channel (its supervisor stops its actors); cut off what is left."""
        for proc in self.procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        self.wait(grace_s)
        for host, proc in self.procs.items():
            if proc.poll() is None:
                self.say(f"{host}: still running {grace_s:g} s after the stop: cutting its ssh off")
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        self.poll()


def _join_secret(run_dir: Path) -> str | None:
    """The learner's join secret for a fleet started by hand: $ASYNCVLA_JOIN_SECRET, else the run
    directory's own when --run-dir is the learner's (None: the learner uses CURVE keys)."""
    from asyncvla.common.transport.auth import JOIN_SECRET_FILE, join_secret_from_env, read_join_secret
    if join_secret_from_env():
        return join_secret_from_env()
    return read_join_secret(run_dir) if (run_dir / JOIN_SECRET_FILE).is_file() else None


def _bundle_files(bundle: Path | None) -> dict[str, str]:
    if bundle is None:
        return {}
    return {p.name: p.read_text() for p in sorted(bundle.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    p = sub.add_parser("actors", help="start, watch and stop actors on many hosts over ssh",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", required=True, help="actor hosts, one 'HOST slots=N' per line")
    p.add_argument("--learner", required=True, metavar="tcp://HOST:PORT",
                   help="the learner's control endpoint, as the hosts reach it")
    p.add_argument("--per-host", type=int, metavar="N", help="actors on every host (default: each host's slots)")
    p.add_argument("--keys-dir", help="the learner's `asyncvla keygen` folder: host i gets client bundle i")
    p.add_argument("--run-dir", default="runs/actors",
                   help="where each host writes its actors' logs: RUN_DIR/actors/HOST (default %(default)s)")
    p.add_argument("--max-restarts", type=int, default=5, help="restarts per crashed actor (default %(default)s)")
    p.add_argument("--placement", default="all", help="cores of each host's actors (launch.placement.actors)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        if args.per_host is not None and args.per_host < 1:
            raise HostfileError(f"--per-host={args.per_host} must be >= 1")
        hosts = read_hostfile(args.hostfile, args.per_host)
        fleet = Fleet(hosts, args.learner, Path(args.run_dir).resolve(), args.keys_dir, args.max_restarts,
                      args.placement, join_secret=_join_secret(Path(args.run_dir)))
    except HostfileError as e:
        print(f"asyncvla actors: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    try:
        while fleet.poll() and not stop.wait(0.5):
            pass
    finally:
        if stop.is_set():
            fleet.say("stopping every host's actors")
        fleet.stop()
    reached = [h for h, code in fleet.ended.items() if not (code == UNREACHABLE and not fleet.heard[h])]
    if not reached:
        fleet.say("no actor host could be reached")
        return 1
    return 0 if stop.is_set() or all(fleet.ended[h] == 0 for h in reached) else 1
