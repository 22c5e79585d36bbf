"""Checks that need no DeepSpeed, made before any rank starts: each problem as one line naming the key.

    problems = preflight.problems(cfg, ports=True)   # [] when the run can start

`asyncvla train` stops on any of them before the launcher spends ~10 s starting ranks that would
fail inside a traceback; `asyncvla config` reports the same (ports as a note: they are free or not
at the moment it runs), and `asyncvla pipeline` the env's before minutes of demonstrations. Only
the ManiSkill check imports ManiSkill (and torch): it builds the task without observations, ~2 s
(several tasks: each once more, with a 16 px camera, to compare their sizes).
"""

from __future__ import annotations

import os
import socket

from asyncvla.common.config import Config

def problems(cfg: Config, ports: bool = True) -> list[str]:
    from asyncvla.common import trackers
    out = _run_dir(cfg) + _pretrained(cfg.policy) + _resume(cfg) + _keys(cfg) + \
        _actor_hosts(cfg) + trackers.problems(cfg) + env_problems(cfg)
    if ports:
        out += busy_ports(cfg)
    return out


def env_problems(cfg: Config) -> list[str]:
    """A ManiSkill task id or camera name that a task lacks (the pixel task needs no check), and
    tasks (env.tasks) that do not share one observation and action size."""
    from asyncvla.actors.envs.pixel_task import ENV_ID as PIXEL_REACH_ID
    if cfg.env.id == PIXEL_REACH_ID and not cfg.env.tasks:
        return []
    from asyncvla.actors.envs.maniskill import camera_problem, space_problem
    found = [camera_problem(env_id, cfg.env.camera, cfg.env.render_backend, cfg.env.robot_uids)
             for env_id in [t.id for t in cfg.env.tasks] or [cfg.env.id]]
    found = [p for p in found if p]
    if found or len(cfg.env.tasks) < 2:
        return found
    try:
        problem = space_problem(cfg.env)
    except ValueError as e:            # (a task without an instruction: named in one line)
        problem = str(e)
    return [problem] if problem else []


def _run_dir(cfg: Config) -> list[str]:
    """The run directory and its checkpoints folder: each a directory where it exists, and where
    not, the nearest existing folder above it one this user can write to (the learner's ranks
    would otherwise find out after their start-up, with the launcher's files already written)."""
    from asyncvla.common.rundir import CHECKPOINTS, run_dir
    run = run_dir(cfg)
    where = ("checkpoint.resume's run" if cfg.checkpoint.resume else
             f"logging.output_dir/logging.experiment_name={str(run)!r}")
    for path in (run, run / CHECKPOINTS):
        if path.exists() and not path.is_dir():
            return [f"{path} is a file, not a directory: a run keeps its files in RUN and its checkpoints in "
                    f"RUN/{CHECKPOINTS} (RUN = {where}); move the file away or choose another "
                    "logging.output_dir / logging.experiment_name"]
    above = next((p for p in (run, *run.parents) if p.exists()), None)
    if above is not None and not (above.is_dir() and os.access(above, os.W_OK | os.X_OK)):
        return [f"{above} is not a directory this user can write to, so the run directory {run} cannot be made "
                f"(RUN = {where}); set logging.output_dir to a writable place"]
    return []


def _pretrained(policy) -> list[str]:
    """What keeps policy.pretrained_path from loading, by the kind of policy it holds
    (common/policy/kinds.py)."""
    if not policy.pretrained_path:
        return []
    from asyncvla.common.policy import kinds
    return kinds.preflight(policy)


def _resume(cfg: Config) -> list[str]:
    """checkpoint.resume: a complete checkpoint, trained with the policy shape this config sets (the
    same check as the learner's when it loads it; finding and reading it needs no torch)."""
    if not cfg.checkpoint.resume:
        return []
    from asyncvla.learner import checkpoint
    try:
        problem = checkpoint.check_resume_config(checkpoint.resolve(cfg.checkpoint.resume), cfg)
    except checkpoint.CheckpointError as e:
        problem = str(e)
    return [f"checkpoint.resume={cfg.checkpoint.resume!r}: {problem}"] if problem else []


def _actor_hosts(cfg: Config) -> list[str]:
    """launch.actor_hostfile: readable, well-formed, and hosts other than this one can reach the
    learner (it must not bind loopback only)."""
    if not cfg.launch.actor_hostfile:
        return []
    from asyncvla.launch.fleet import HostfileError, read_hostfile
    try:
        hosts = read_hostfile(cfg.launch.actor_hostfile)
    except HostfileError as e:
        return [f"launch.actor_hostfile: {e}"]
    remote = [h.name for h in hosts if not _loopback(h.name)]
    if remote and _loopback(cfg.transport.bind_host):
        return [f"launch.actor_hostfile names {', '.join(remote[:3])}, which cannot reach a learner bound to "
                f"transport.bind_host={cfg.transport.bind_host}: set transport.bind_host=0.0.0.0 with "
                "transport.keys_dir (CURVE keys), and transport.advertise_host to an address they reach"]
    return []


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.")


def _keys(cfg: Config) -> list[str]:
    if not cfg.transport.keys_dir:
        return []
    from asyncvla.common.transport.sockets import client_keys, server_keys
    try:
        server_keys(cfg.transport.keys_dir)
        if cfg.launch.num_local_actors:         # local actors take the directory's first client bundle
            client_keys(cfg.transport.keys_dir)
    except Exception as e:                      # TransportError, or a malformed key file
        return [str(e)]
    return []


def run_ports(cfg: Config) -> dict[str, int]:
    """The ports this machine's learner binds, by key (rank r pulls on segment_port + r)."""
    t, ranks = cfg.transport, cfg.launch.num_learner_ranks
    out = {"transport.control_port": t.control_port, "transport.weights_port": t.weights_port,
           "launch.master_port": cfg.launch.master_port}
    for r in range(ranks):
        out[f"transport.segment_port (+{r})" if r else "transport.segment_port"] = t.segment_port + r
    return out


def busy_ports(cfg: Config) -> list[str]:
    """Ports of run_ports() another process holds on this machine (not checked with a hostfile:
    the ranks bind on other hosts)."""
    if cfg.launch.hostfile:
        return []
    out, seen = [], {}
    for key, port in run_ports(cfg).items():
        if port in seen:
            out.append(f"{key}={port}: the same port as {seen[port]}; give each its own")
            continue
        seen[port] = key
        host = "127.0.0.1" if key == "launch.master_port" else cfg.transport.bind_host
        reason = _bind_error(host, port)
        if reason:
            out.append(f"{key}={port}: cannot bind {host}:{port} ({reason}); another run may hold it, "
                       "choose another port")
    return out


def _bind_error(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a listener binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None
