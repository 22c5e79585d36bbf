"""Actor fleets on two "hosts" through `asyncvla train --actor-hostfile`, for real: ssh to a private
sshd on 127.0.0.5 and 127.0.0.6 (tests/benchmarks/multinode.py), one supervisor per host
(`asyncvla actor-host`), CURVE client keys handed out over the ssh channel.

1. To the budget: both hosts' actors join a local ZeRO-3 learner and train it to learner.max_steps;
   every process on both hosts ends, and the keys each host got are gone.
2. Under faults, with a third host that cannot be reached: it is named in one line and the others
   train; each host's keys are private (0700 folder, 0600 files) while it runs; a remote actor
   killed with SIGKILL is restarted by its host's supervisor; Ctrl-C to the launcher writes a
   final checkpoint and leaves no process on any host 5 s after it exits.
3. `asyncvla actors` beside a learner started apart: Ctrl-C stops every remote actor within
   seconds; a SIGKILL leaves none either.

~2 minutes on 2 cores. Needs root (sshd, an ssh client drop-in) like tests/test_multinode.py.
`asyncvla actors --hostfile` against a learner started apart runs the same Fleet (launch/fleet.py);
its hostfile and key errors are checked first, without ssh.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmarks import multinode
from tests.support.paths import REPO
from tests.support.ports import free_ports, run_ports
from tests.support.runs import SMALL, SMALL_BACKBONE

HOSTS = ("127.0.0.5", "127.0.0.6")   # not test_multinode's nodes: make test may run both files at once
UNREACHABLE = "127.0.0.4"          # no sshd listens there
FLEET_RUN = [*SMALL, "eval.eval_interval=0", "launch.num_local_actors=0", "transport.bind_host=0.0.0.0",
             "logging.progress=false", *SMALL_BACKBONE]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    missing = multinode.prerequisites()
    if missing:
        pytest.skip(missing)
    from asyncvla.launch.keygen import generate
    tmp = tmp_path_factory.mktemp("fleet")
    generate(tmp / "keys", 0)          # the learner's keys; `train --actor-hostfile` adds a bundle per host
    with multinode.ssh_nodes(tmp / "ssh", HOSTS, free_ports(1)[0]):
        yield tmp
    multinode._kill_leftovers(str(tmp))


def pick_ports() -> tuple[int, ...]:
    """(control, weights, trajectory, master) ports, free: the private sshd's port is held, so not among them."""
    return tuple(run_ports().values())


def start_train(tmp: Path, name: str, host_lines: list[str] | None, overrides: list[str],
                ports: tuple[int, ...] | None = None) -> tuple[subprocess.Popen, Path]:
    """`asyncvla train` with CURVE keys on free ports, its actors from `host_lines` (--actor-hostfile)."""
    control, weights, trajectory, master = ports or pick_ports()
    fleet = []
    if host_lines:
        hostfile = tmp / f"{name}.hosts"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in host_lines))
        fleet = ["--actor-hostfile", str(hostfile)]
    env_file = tmp / "deepspeed_env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in multinode.RANK_ENV.items()))
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", "configs/pixel_task.yaml", *FLEET_RUN, *overrides,
           f"logging.output_dir={tmp / 'runs'}", f"logging.experiment_name={name}",
           f"transport.keys_dir={tmp / 'keys'}", f"transport.control_port={control}",
           f"transport.weights_port={weights}", f"transport.segment_port={trajectory}",
           f"launch.master_port={master}", *fleet]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, DS_ENV_FILE=str(env_file), PYTHONUNBUFFERED="1"))
    return proc, log


def start_fleet(tmp: Path, name: str, control: str, run: Path, slots: int = 1, extra=()) -> subprocess.Popen:
    """`asyncvla actors` on HOSTS for a learner started apart, its output in tmp/<name>-actors.log."""
    hostfile = tmp / f"{name}.hosts"
    hostfile.write_text("".join(f"{h} slots={slots}\n" for h in HOSTS))
    with open(tmp / f"{name}-actors.log", "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "asyncvla.launch.cli", "actors", "--hostfile", str(hostfile),
                                 "--learner", control, "--keys-dir", str(tmp / "keys"), "--run-dir", str(run), *extra],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, DS_ENV_FILE=str(tmp / "deepspeed_env")))


def stop_fleet(fleet: subprocess.Popen) -> None:
    """What a failed test leaves of `asyncvla actors`: Ctrl-C (it stops every host's actors), then
    SIGKILL. (It shares the test's process group: no signal to the group.)"""
    if fleet.poll() is None:
        fleet.send_signal(signal.SIGINT)
        try:
            fleet.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fleet.kill()
            fleet.wait()


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, log.read_text(errors="replace") if log.exists() else "")   # (not yet written)
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    text = log.read_text(errors="replace") if log.exists() else f"({log} not written)"
    raise AssertionError(f"no {pattern!r} in the log (exit {proc.poll()}):\n{text[-4000:]}")


def processes_naming(marker: str) -> list[str]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            except OSError:
                continue
            if marker in cmdline:
                out.append(f"{entry.name}: {cmdline[:160]}")
    return out


def remote_actor_pid(run_dir: Path, actor_id: str) -> int | None:
    for line in processes_naming(str(run_dir)):
        pid, cmdline = line.split(": ", 1)
        if " actor " in cmdline and f"--actor-id {actor_id} " in cmdline:
            return int(pid)
    return None


def test_hostfiles_are_read_as_deepspeed_writes_them_and_errors_name_the_line(tmp_path):
    from asyncvla.launch.fleet import HostfileError, client_bundles, read_hostfile
    from asyncvla.launch.keygen import generate

    f = tmp_path / "hosts"
    f.write_text("# actor nodes\nnode-a slots=16\n\nnode-b   slots = 4  # small one\nnode-c\n")
    hosts = read_hostfile(f)
    assert [(h.name, h.actors, h.first_index) for h in hosts] == [("node-a", 16, 0), ("node-b", 4, 16),
                                                                   ("node-c", 1, 20)]
    assert [h.actors for h in read_hostfile(f, per_host=2)] == [2, 2, 2]
    for text, said in (("node-a slots=x\n", ":1: 'node-a slots=x' is not 'HOST slots=N'"),
                       ("a slots=1\na slots=2\n", ":2: host a is listed twice"),
                       ("a slots=0\n", "slots=0: a host needs at least 1 actor"), ("# none\n", "names no host")):
        f.write_text(text)
        with pytest.raises(HostfileError, match=re.escape(said)):
            read_hostfile(f)
    with pytest.raises(HostfileError, match="cannot read the actor hostfile"):
        read_hostfile(tmp_path / "missing")
    generate(tmp_path / "keys", 1)
    assert len(client_bundles(tmp_path / "keys", 1)) == 1
    with pytest.raises(HostfileError, match=r"3 actor hosts need 3 client key bundles, .* has 1: run "
                                            r"`asyncvla keygen .* --clients 2`"):
        client_bundles(tmp_path / "keys", 3)


def test_a_learner_bound_to_loopback_is_refused_for_remote_actor_hosts(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("node-a slots=2\n")
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", "configs/pixel_task.yaml",
                        f"launch.actor_hostfile={f}", f"logging.output_dir={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "launch.actor_hostfile names node-a, which cannot reach a learner bound to " \
        "transport.bind_host=127.0.0.1: set transport.bind_host=0.0.0.0" in r.stderr, r.stderr


SBATCH = REPO / "launch" / "slurm" / "asyncvla.sbatch"


def sbatch_dry_run(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), "configs/maniskill_gpu.yaml", "learner.max_steps=10"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, DRY_RUN="1", NODES="gpu-0 cpu-1 cpu-2", **env))


def test_the_slurm_script_parses_and_its_dry_run_prints_the_learner_and_fleet_commands(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    r = sbatch_dry_run(tmp_path, GPUS_PER_NODE="8", ACTORS_PER_NODE="12")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "    cpu-1 slots=12" in lines and "    cpu-2 slots=12" in lines
    train = [x for x in lines if " train " in x]
    assert len(train) == 1 and train[0].startswith("+ srun --nodes=1 --ntasks=1 -w gpu-0 ")
    for part in ("transport.bind_host=0.0.0.0", "transport.advertise_host=gpu-0", "launch.num_local_actors=0",
                 "--num-learner-ranks 8", "--actor-hostfile runs/actor_hosts.", "learner.max_steps=10"):
        assert part in train[0], (part, train[0])
    r = sbatch_dry_run(tmp_path, ACTOR_LAUNCH="srun")
    assert r.returncode == 0, r.stderr
    hosts = sorted(x for x in r.stdout.splitlines() if " actor-host " in x)
    assert len(hosts) == 2 and all("--no-stdin --learner tcp://gpu-0:5555" in x for x in hosts), hosts
    assert "-w cpu-1 " in hosts[0] and "--first-index 0 " in hosts[0] and "client_000" in hosts[0]
    assert "-w cpu-2 " in hosts[1] and "--first-index 16 " in hosts[1] and "client_001" in hosts[1]
    assert "keygen runs/keys --clients 2" in r.stdout
    assert not (tmp_path / "runs").exists()                 # a dry run writes nothing
    for env, said in (({"ACTOR_LAUNCH": "pdsh"}, "ACTOR_LAUNCH=pdsh: allowed ssh or srun"),
                      ({"NODES": "gpu-0"}, "1 node(s): needs 2 or more")):
        r = subprocess.run(["bash", str(SBATCH), "c.yaml"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "DRY_RUN": "1", "NODES": "a b", **env})
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_fleets_on_two_hosts_train_to_the_budget_and_leave_nothing(hosts):
    """`asyncvla actors` beside a learner started apart: its hosts' actors join and train it."""
    from asyncvla.launch.keygen import generate
    generate(hosts / "keys", 2)                # (the learner reads its authorized clients at start)
    run, ports = hosts / "runs" / "budget", pick_ports()
    fleet_log = hosts / "budget-actors.log"                 # (start_fleet's)
    # The fleet first, its actors waiting for the learner; and the learner waits for both before
    # its first update (learner.min_actors): an actor that joined only after the budget was spent
    # (a host slow to start, or one whose hello comes a back-off later) would wait for ever, and
    # its host with it.
    fleet = start_fleet(hosts, "budget", f"tcp://{socket.gethostname()}:{ports[0]}", run, slots=4,
                        extra=["--per-host", "1"])
    proc = None
    try:
        for host in HOSTS:
            wait_for(run / "actors" / host / "actor_0.log", r"no answer from the learner", fleet)
        proc, log = start_train(hosts, "budget", None, ["learner.max_steps=20", "learner.min_actors=2"], ports)
        code = proc.wait(timeout=300)
        fleet_code = fleet.wait(timeout=60)
    finally:
        stop_fleet(fleet)
        if proc is not None:
            multinode._stop_group(proc)
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "finished at step 20" in text and "2 actors joined after" in text
    text = fleet_log.read_text(errors="replace")
    assert fleet_code == 0, text
    for host in HOSTS:
        assert f"asyncvla actors: {host}: 1/1 actors running" in text, text[-3000:]
        actor_log = (run / "actors" / host / "actor_0.log").read_text(errors="replace")
        assert "first segment sent" in actor_log, actor_log[-2000:]
        assert not (run / "actors" / host / "keys").exists()        # deleted when the host stopped
    time.sleep(1)
    assert not processes_naming(str(run)), processes_naming(str(run))


def test_a_crash_an_unreachable_host_and_ctrl_c(hosts):
    proc, log = start_train(hosts, "faults", [*HOSTS, UNREACHABLE], ["learner.max_steps=1000000",
                                                                    "checkpoint.save_interval=5"])
    run = hosts / "runs" / "faults"
    try:
        wait_for(log, rf"asyncvla actors: {re.escape(UNREACHABLE)}: cannot be reached .*the other hosts go on", proc)
        for host in HOSTS:
            wait_for(log, rf"asyncvla actors: {re.escape(host)}: 1/1 actors running", proc)
            keys = run / "actors" / host / "keys"
            assert stat.S_IMODE(keys.stat().st_mode) == 0o700
            assert {stat.S_IMODE(p.stat().st_mode) for p in keys.iterdir()} == {0o600}
            assert {p.name for p in keys.iterdir()} == {"client.key", "client.key_secret", "server.key"}
        wait_for(log, r"checkpoint \S*step_00000005 complete", proc)          # both hosts' actors feed the learner

        victim = remote_actor_pid(run, f"{HOSTS[0]}-0")
        assert victim is not None, processes_naming(str(run))
        os.kill(victim, signal.SIGKILL)
        wait_for(log, rf"{re.escape(HOSTS[0])}: actor {re.escape(HOSTS[0])}-0 exited with -9; restart 1/", proc)
        wait_for(log, r"checkpoint \S*step_00000010 complete", proc)          # and training goes on

        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
        gone_at = time.time()
    finally:
        multinode._stop_group(proc)
    text = log.read_text(errors="replace")
    assert code == 130, text[-4000:]           # stopped by Ctrl-C: not a finish
    final = re.search(r"stopped by SIGINT at update \d+; final checkpoint (\S+); it holds step (\d+)", text)
    assert final and (Path(final.group(1)) / "COMPLETE.json").exists(), text[-3000:]
    while processes_naming(str(run)) and time.time() - gone_at < 5:
        time.sleep(0.2)
    assert not processes_naming(str(run)), processes_naming(str(run))


def test_ctrl_c_to_asyncvla_actors_stops_every_remote_actor_within_seconds(hosts):
    """The learner keeps running; Ctrl-C to `asyncvla actors` closes each host's channel and its
    supervisor stops the actors: nothing of the fleet is left once the command has exited."""
    from asyncvla.launch.keygen import generate
    generate(hosts / "keys", 2)
    proc, log = start_train(hosts, "stop", None, ["learner.max_steps=1000000", "checkpoint.save_interval=2"])
    run = hosts / "runs" / "stop"
    fleet_log = hosts / "stop-actors.log"
    try:
        control = wait_for(log, r"actors join at (\S+)", proc).group(1)
        fleet = start_fleet(hosts, "stop", control, run)
        for host in HOSTS:
            wait_for(fleet_log, rf"{re.escape(host)}: 1/1 actors running", fleet)
        wait_for(log, r"checkpoint \S*step_00000002 complete", proc)
        t0 = time.time()
        fleet.send_signal(signal.SIGINT)
        fleet_code = fleet.wait(timeout=30)
        took = time.time() - t0
        left = [p for p in processes_naming(str(run)) if " actor" in p]
        assert proc.poll() is None                       # the learner is not the fleet's to stop
    finally:
        multinode._stop_group(proc)
    text = fleet_log.read_text(errors="replace")
    assert fleet_code == 0 and not left, (left, text)
    assert took < 15 and "stopping every host's actors" in text, (took, text)
    for host in HOSTS:
        assert f"{host}: stopped;" in text, text


def test_a_killed_asyncvla_actors_leaves_no_actor_on_the_hosts(hosts):
    """SIGKILL, no chance to clean up: its ssh processes die with it (parent-death signal), each
    host's channel closes, and the supervisors stop their actors."""
    from asyncvla.launch.keygen import generate
    generate(hosts / "keys", 2)
    proc, log = start_train(hosts, "kill", None, ["learner.max_steps=1000000"])
    run = hosts / "runs" / "kill"
    try:
        control = wait_for(log, r"actors join at (\S+)", proc).group(1)
        fleet = start_fleet(hosts, "kill", control, run)
        for host in HOSTS:
            wait_for(hosts / "kill-actors.log", rf"{re.escape(host)}: 1/1 actors running", fleet)
        # asyncvla actors, and per host its supervisor (actor-host) and actor
        assert len([p for p in processes_naming(str(run)) if " actor" in p]) == 1 + 2 * len(HOSTS)
        fleet.send_signal(signal.SIGKILL)
        fleet.wait()
        gone_at = time.time()
        while [p for p in processes_naming(str(run)) if " actor" in p] and time.time() - gone_at < 15:
            time.sleep(0.2)
        left = [p for p in processes_naming(str(run)) if " actor" in p]
    finally:
        multinode._stop_group(proc)
    assert not left, left
