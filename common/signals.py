"""Graceful stop for the actor and learner processes, and no orphans when the launcher dies.

`asyncvla train` names itself in LAUNCHER_PID_ENV for every process it starts (the variable is
inherited down the tree: the deepspeed runner, its per-node launcher, the learner ranks). Its
direct children get a parent-death signal (`die_with_parent`, as Popen's preexec_fn); the
learner ranks are its grandchildren, which the kernel's parent-death signal cannot reach, so each
process that calls `stop_on_signals` also watches the launcher itself (`exit_with_launcher`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

LAUNCHER_PID_ENV = "ASYNCVLA_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1            # linux/prctl.h
WATCH_INTERVAL_S = 0.5


class StopFlag(threading.Event):
    """Set by the first SIGTERM or SIGINT; `signum` says which. A process stopped this way exits
    with `exit_code` (128 + the signal's number, as a shell reports it): 0 is kept for a process
    that ended by itself (its budget, or the learner's "shutdown")."""

    signum: int | None = None

    def exit_code(self, default: int = 0) -> int:
        return 128 + self.signum if self.signum is not None else default


def stop_on_signals() -> StopFlag:
    """An event set by SIGTERM or SIGINT, so a main loop can finish its step and close cleanly.
    Under `asyncvla train`, the process also ends at once if the launcher is killed."""
    stop = StopFlag()

    def handler(signum, frame):
        if stop.signum is None:
            stop.signum = signum
        stop.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    exit_with_launcher()
    return stop


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has installed a handler for `sig` (/proc/PID/status SigCgt): a process
    still starting up would die of the signal instead of stopping cleanly."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only; a no-op
    elsewhere). Meant for a child between fork and exec: the setting survives exec."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:       # the parent died before the prctl: no signal will come
        os._exit(1)


def exit_with_launcher(interval_s: float = WATCH_INTERVAL_S) -> None:
    """When started under `asyncvla train`, exit within `interval_s` of the launcher's end.

    No graceful stop here: a launcher that ended without stopping its children was killed
    (SIGKILL, OOM), and the run resumes from its last complete checkpoint. A no-op without
    LAUNCHER_PID_ENV or off Linux."""
    pid = int(os.environ.get(LAUNCHER_PID_ENV, 0) or 0)
    if pid <= 0 or not sys.platform.startswith("linux"):
        return
    started = process_start_time(pid)

    def watch():
        while started is not None and process_start_time(pid) == started:
            time.sleep(interval_s)
        print(f"asyncvla: the launcher (pid {pid}) is gone; pid {os.getpid()} exits", file=sys.stderr,
              flush=True)
        os._exit(1)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def process_start_time(pid: int) -> int | None:
    """The start time of a live process (/proc/PID/stat field 22), None if it is gone or a zombie.
    A pid can be reused; (pid, start time) names one process."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, ())
    return out


def python_module(pid: int) -> str | None:
    """The module a Python process runs (`python ... -m MODULE ...`), or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return argv[argv.index(b"-m") + 1].decode() if b"-m" in argv[:-1] else None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; the command name before it may hold spaces."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
