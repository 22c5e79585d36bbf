"""Two learner nodes through `asyncvla train --hostfile`, for real: ssh + pdsh, CURVE actors, resume.

Why: `--hostfile` is the multi-node path, and nothing else runs it. One machine stands in for two
nodes: a private sshd (its own config, host key and authorized key in a temporary directory)
listens on the loopback aliases 127.0.0.2 and 127.0.0.3, which the hostfile names as two nodes of
one slot each. The deepspeed launcher reaches both with plain `ssh` (its reachability check and
`hostname -I` for the rendezvous address) and `pdsh -R ssh` (the ranks), so the ssh client learns
the port, key and host key from a drop-in in /etc/ssh/ssh_config.d/ that exists only while this
runs. Environment for the ranks goes through a deepspeed env file (DS_ENV_FILE): the launcher's own
environment does not reach them. Then, from the repository root:

    asyncvla keygen KEYS --clients 2
    asyncvla train configs/pixel_task.yaml transport.bind_host=0.0.0.0 transport.keys_dir=KEYS
        launch.num_local_actors=0 learner.max_steps=6 checkpoint.save_interval=3 ... --hostfile HOSTFILE
    asyncvla actor --learner tcp://127.0.0.2:PORT --keys-dir KEYS/clients/client_00N    (x 2)
    asyncvla train ... learner.max_steps=9 --hostfile HOSTFILE --resume RUN           (+ 2 new actors)

and checks that each run ends with 0, that both nodes' ranks trained (pdsh labels each line with
its host), that the last checkpoint is complete with world size 2 and both ranks' ZeRO shards,
and that the resumed run continued from step 6 to 9. ~1.5 minutes on 2 otherwise idle cores
(ranks and actors start twice; the updates are a few seconds).

Needs root (the sshd, the client drop-in) and openssh-server + pdsh, which it installs with
apt-get when they are missing; where it cannot, it reports "skipped: <reason>". Everything it
started (sshd, launcher, ranks, actors) and wrote outside its temporary directory is removed.

    python -m tests.benchmarks.multinode [--out bench_results/multinode.json]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.benchmarks.report import ROOT, Figure, main
from tests.support.ports import free_ports, run_ports

NODES = ("127.0.0.2", "127.0.0.3")     # loopback aliases: every 127.x.y.z reaches lo on Linux
STEPS, RESUMED_STEPS, SAVE_INTERVAL = 6, 9, 3
NUM_ACTORS = 2
RUN_TIMEOUT_S = 360
# ssh reads every file here; each private sshd gets its own (named for its hosts), and whoever runs
# two at once (make test's two workers: this check and tests/test_fleet.py) gives them other hosts.
SSH_DROP_IN_DIR = Path("/etc/ssh/ssh_config.d")
PACKAGES = {"pdsh": "pdsh", "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
OVERRIDES = [f"learner.max_steps={STEPS}", f"checkpoint.save_interval={SAVE_INTERVAL}",
             "launch.num_local_actors=0", "logging.progress=false", "transport.bind_host=0.0.0.0"]
# What the ranks on both nodes get through the env file: CPU ranks (two ranks on one machine
# cannot share its one GPU under NCCL), one thread each on a shared machine.
RANK_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def run(quick: bool = False) -> dict:
    missing = prerequisites()
    if missing:
        return {"skipped": missing}
    with tempfile.TemporaryDirectory(prefix="asyncvla-multinode-") as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        ports = _ports()
        stack.enter_context(ssh_nodes(tmp / "ssh", NODES, ports["ssh"]))
        stack.callback(_kill_leftovers, str(tmp))           # ranks on "other nodes" the launcher missed
        hostfile = tmp / "hostfile"
        hostfile.write_text("".join(f"{host} slots=1\n" for host in NODES))
        env_file = tmp / "deepspeed_env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in RANK_ENV.items()))
        keys = tmp / "keys"
        _check_call(_asyncvla("keygen", str(keys), "--clients", str(NUM_ACTORS)))
        bundles = sorted((keys / "clients").iterdir())
        overrides = OVERRIDES + [f"logging.output_dir={tmp / 'runs'}", "logging.experiment_name=multinode",
                                 f"transport.keys_dir={keys}", f"transport.control_port={ports['control']}",
                                 f"transport.weights_port={ports['weights']}",
                                 f"transport.segment_port={ports['segment']}",
                                 f"launch.master_port={ports['master']}"]
        control = f"tcp://{NODES[0]}:{ports['control']}"
        env = dict(os.environ, DS_ENV_FILE=str(env_file), PYTHONUNBUFFERED="1")
        run_dir = tmp / "runs" / "multinode"

        # (overrides right after the config: argparse takes no positionals after the options)
        first = train_run(tmp / "train.log", ["train", "configs/pixel_task.yaml", *overrides,
                                              "--hostfile", str(hostfile)], control, bundles, env, "a")
        first["checkpoint"] = last_checkpoint(run_dir)
        check({"train": first})                 # no resume of a run that did not save
        resumed = train_run(tmp / "resume.log", ["train", "configs/pixel_task.yaml", *overrides,
                                                 f"learner.max_steps={RESUMED_STEPS}", "--hostfile", str(hostfile),
                                                 "--resume", str(run_dir)], control, bundles, env, "b")
        resumed["checkpoint"] = last_checkpoint(run_dir)
        result = {"nodes": list(NODES), "ports": ports, "overrides": overrides, "rank_env": RANK_ENV,
                  "ssh_connections": ssh_connections(tmp / "ssh" / "sshd.log"), "train": first, "resume": resumed}
        check(result)
        return result


def train_run(log_path: Path, args: list[str], control: str, bundles: list[Path], env: dict, tag: str) -> dict:
    """One `asyncvla train --hostfile` with standalone actors joining over TCP; its record."""
    t0 = time.perf_counter()
    procs = []
    with open(log_path, "wb") as log:
        try:
            launcher = _start(_asyncvla(*args), log, env)
            procs.append(launcher)
            # Actors started before the learner listens retry with back-off (up to
            # transport.reconnect_max_s, 5 s) and could join after a 3-update run has ended.
            _wait_for_log(log_path, "actors join at", launcher, RUN_TIMEOUT_S)
            actors = [_start(_asyncvla("actor", "--learner", control, "--keys-dir", str(bundle),
                                       "--actor-id", f"node-{tag}{i}", "--join-timeout", str(RUN_TIMEOUT_S)),
                             log, env) for i, bundle in enumerate(bundles)]
            procs += actors
            try:
                code = launcher.wait(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            actor_codes = []
            for a in actors:               # they end on the learner's "shutdown"
                try:
                    actor_codes.append(a.wait(timeout=30 if code == 0 else 0.1))
                except subprocess.TimeoutExpired:
                    actor_codes.append(None)
        finally:
            for p in procs:
                _stop_group(p)
    text = log_path.read_text(errors="replace")
    record = {"exit_code": code, "actor_exit_codes": actor_codes, "wall_s": time.perf_counter() - t0,
              "lines_per_node": {h: sum(1 for line in text.splitlines() if line.startswith(f"{h}: "))
                                 for h in NODES},
              "finished": _node_matches(text, r"finished at step (\d+)"),
              "resumed_at": _node_matches(text, r"resumed from .* at step (\d+)"),
              "log_tail": text[-4000:]}
    return record


def _wait_for_log(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `text` appears in the log at `path` (or `proc` exits, or `timeout` passes: then the
    run's own checks report what went wrong)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)


def check(r: dict) -> None:
    """Raise (with the logs' tails) unless the runs in `r` trained on both nodes and saved, and
    the resumed one (when there) continued from the first one's last step."""
    problems = []
    for name, run_, steps in (("train", r.get("train"), STEPS), ("resume", r.get("resume"), RESUMED_STEPS)):
        if run_ is None:
            continue
        if run_["exit_code"] != 0:
            problems.append(f"{name}: asyncvla train exited with {run_['exit_code']}")
        if any(c != 0 for c in run_["actor_exit_codes"]):
            problems.append(f"{name}: actor exit codes {run_['actor_exit_codes']}")
        for host in NODES:
            if run_["finished"].get(host) != [steps]:
                problems.append(f"{name}: the rank on {host} did not finish at step {steps} "
                                f"(finished: {run_['finished']})")
        ckpt = run_["checkpoint"]
        if ckpt is None or ckpt["step"] != steps or ckpt["world_size"] != 2 or ckpt["ranks_with_shards"] != [0, 1]:
            problems.append(f"{name}: last complete checkpoint {ckpt}, expected step {steps} of 2 ranks' shards")
    if "ssh_connections" in r and any(r["ssh_connections"].get(h, 0) < 2 for h in NODES):
        problems.append(f"sshd saw too few connections per node for two runs: {r['ssh_connections']}")
    if "resume" in r and any(r["resume"]["resumed_at"].get(h) != [STEPS] for h in NODES):
        problems.append(f"resume: not every rank resumed at step {STEPS} ({r['resume']['resumed_at']})")
    if problems:
        tails = "\n".join(f"--- {n} log tail ---\n{r[n]['log_tail']}" for n in ("train", "resume") if n in r)
        raise RuntimeError("; ".join(problems) + "\n" + tails)


def last_checkpoint(run_dir: Path) -> dict | None:
    """The newest complete checkpoint's step, world size and the ranks whose ZeRO shards it lists."""
    pointer = run_dir / "checkpoints" / "latest_complete"
    if not pointer.is_file():
        return None
    tag = run_dir / "checkpoints" / pointer.read_text().strip()
    marker = json.loads((tag / "COMPLETE.json").read_text())
    ranks = sorted({int(m.group(1)) for name in marker["files"]
                    if (m := re.match(r"zero_pp_rank_(\d+)_.*optim_states\.pt$", name))})
    return {"tag": tag.name, "step": marker["step"], "world_size": marker["world_size"],
            "ranks_with_shards": ranks, "files": len(marker["files"])}


def ssh_connections(sshd_log: Path) -> dict[str, int]:
    """How many ssh connections the private sshd took on each node's address."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"Connection from \S+ port \d+ on (\S+) port", sshd_log.read_text(errors="replace")):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# --------------------------------------------------------------------------------- two "nodes"
def prerequisites() -> str | None:
    """None when the check can run here, else why not; installs pdsh and openssh-server if absent."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux (a private sshd, an ssh client drop-in in /etc/ssh/ssh_config.d)"
    import zmq
    if not zmq.has("curve"):
        return "libzmq without CURVE"
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if not _which(tool)})
    if missing:
        if not shutil.which("apt-get"):
            return f"{', '.join(missing)} not installed and no apt-get"
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
        ok = subprocess.run(install, env=env, capture_output=True).returncode == 0
        if not ok:      # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            proc = subprocess.run(install, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                return f"apt-get install {' '.join(missing)} failed: {proc.stderr.strip()[-300:]}"
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    if not addresses:
        return "no network address (`hostname -I` is empty): deepspeed takes rank 0's from it"
    if not SSH_DROP_IN_DIR.is_dir():
        return f"no {SSH_DROP_IN_DIR} (the ssh client's drop-in folder)"
    return None


@contextmanager
def ssh_nodes(folder: Path, hosts: tuple[str, ...], port: int):
    """A private sshd on `hosts`:`port` that lets this user in with a key of its own, and the ssh
    client set up to use it (port, key, the sshd's host key: checked, not ignored)."""
    folder.mkdir(mode=0o700)
    for key in ("host_key", "client_key"):
        _check_call(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "asyncvla-multinode", "-f",
                     str(folder / key)])
    shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
    host_key = " ".join((folder / "host_key.pub").read_text().split()[:2])
    (folder / "known_hosts").write_text("".join(f"[{h}]:{port} {host_key}\n" for h in hosts))
    (folder / "sshd_config").write_text(
        f"Port {port}\n" + "".join(f"ListenAddress {h}\n" for h in hosts) +
        f"HostKey {folder / 'host_key'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
        f"PidFile {folder / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\nX11Forwarding no\n"
        "AllowTcpForwarding no\nLogLevel VERBOSE\n")
    # sshd refuses to start without its privilege-separation folder (made by openssh-server's
    # service, which nothing starts here). It stays: another private sshd may still be using it.
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(folder / "sshd.log", "wb") as log:
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(folder / "sshd_config")],
                                stdout=log, stderr=subprocess.STDOUT)
    drop_in = SSH_DROP_IN_DIR / f"asyncvla-multinode-{'-'.join(hosts)}.conf"
    try:
        drop_in.write_text(
            f"# asyncvla multinode check: removed when it ends\nHost {' '.join(hosts)}\n"
            f"    Port {port}\n    IdentityFile {folder / 'client_key'}\n    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {folder / 'known_hosts'}\n    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n")
        deadline = time.time() + 20
        while subprocess.run(["ssh", hosts[-1], "true"], capture_output=True).returncode != 0:
            if sshd.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ssh to {hosts[-1]}:{port} does not work: "
                                   f"{(folder / 'sshd.log').read_text()[-1000:]}")
            time.sleep(0.3)
        yield
    finally:
        drop_in.unlink(missing_ok=True)
        sshd.terminate()
        try:
            sshd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sshd.kill()
            sshd.wait()


# --------------------------------------------------------------------------------- helpers
def _ports() -> dict:
    """Free ports; the trajectory port's successor (rank 1's) free as well."""
    (ssh,), run = free_ports(1), run_ports()
    return {"ssh": ssh, "control": run["transport.control_port"], "weights": run["transport.weights_port"],
            "segment": run["transport.segment_port"], "master": run["launch.master_port"]}


def _asyncvla(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("asyncvla")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "asyncvla.launch.cli", *args]


def _start(cmd: list[str], log, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _check_call(cmd: list[str]) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the process group (the launcher then stops its children), SIGKILL after grace_s."""
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_leftovers(marker: str) -> None:
    """SIGKILL any process whose command line names this check's temporary directory: ranks
    started through sshd are in no process group of ours."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _node_matches(text: str, pattern: str) -> dict[str, list[int]]:
    """{host: [ints]} of a pattern in the lines pdsh labelled with that host."""
    out: dict[str, list[int]] = {}
    for host in NODES:
        for line in text.splitlines():
            if line.startswith(f"{host}: ") and (m := re.search(pattern, line)):
                out.setdefault(host, []).append(int(m.group(1)))
    return out


def _which(tool: str) -> bool:
    return bool(shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin"))


def figures(r: dict) -> list[Figure]:
    if "skipped" in r:
        return [Figure("multinode", "2 nodes x 1 rank: train, checkpoint, resume", None,
                       note=f"skipped: {r['skipped']}")]
    t, s = r["train"], r["resume"]
    return [
        Figure("multinode", "2 nodes x 1 rank (ssh + pdsh): updates", t["checkpoint"]["step"], goal=f"= {STEPS}",
               met=t["checkpoint"]["step"] == STEPS, note=f"{t['wall_s']:.0f} s incl. start-up, 2 CURVE actors"),
        Figure("multinode", "ranks' shards in the last checkpoint", len(t["checkpoint"]["ranks_with_shards"]),
               goal="= 2", met=t["checkpoint"]["ranks_with_shards"] == [0, 1], note=t["checkpoint"]["tag"]),
        Figure("multinode", f"resumed from step {STEPS}: updates", s["checkpoint"]["step"],
               goal=f"= {RESUMED_STEPS}", met=s["checkpoint"]["step"] == RESUMED_STEPS,
               note=f"{s['wall_s']:.0f} s incl. start-up"),
    ]


if __name__ == "__main__":
    main(sys.modules[__name__])
