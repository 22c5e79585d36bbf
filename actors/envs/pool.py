"""Single-env runners driven in worker processes, one round trip per action chunk.

    worker = Worker(ctx, make_runner, spec, index)   # make_runner(spec) runs in the child
    worker.send("step_chunk", actions, seed); result = worker.recv(timeout)
    shutdown([worker, ...])

or `InProcess(make_runner, spec)`, the same interface without a process (a lone env).

Why not gymnasium's vector envs: AsyncVectorEnv sends one action per message and resets an
ended env on its next step. Here a message carries a whole chunk of K actions, which the worker
steps (stopping where the episode ends), then resets with the episode seed the parent chose and
answers with the final observation, the new one and the chunk's rewards — K times fewer round
trips, and auto-reset semantics the learner's truncation bootstrap relies on (actors/envs/base.py).
"""

from __future__ import annotations

import signal
import traceback
from typing import Callable


class InProcess:
    """A runner in this process, with the send/recv interface of a worker."""

    def __init__(self, make_runner: Callable, spec):
        self.runner = make_runner(spec)
        self._result = self.runner.info

    def send(self, method: str, *args) -> None:
        self._result = getattr(self.runner, method)(*args)

    def recv(self, timeout: float):
        return self._result

    def request_close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def join(self) -> None:
        pass


class Worker:
    """A runner in a child process, driven over a pipe: (method, args) -> (ok, result). The
    first answer (recv) is the runner's `info`."""

    def __init__(self, ctx, make_runner: Callable, spec, index: int, label: str = "env"):
        self.index, self.label = index, label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, make_runner, spec), daemon=True,
                                name=f"env-worker-{index}")
        self.proc.start()
        child.close()

    def send(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"env worker {self.index} ({self.label}) gave no answer in {timeout:.0f} s")
        try:
            ok, result = self.conn.recv()
        except (EOFError, ConnectionError):
            self.proc.join(1.0)
            raise RuntimeError(f"env worker {self.index} ({self.label}) died (exit code "
                               f"{self.proc.exitcode})") from None
        if not ok:
            last = result.strip().splitlines()[-1]
            raise RuntimeError(f"env worker {self.index} ({self.label}) failed: {last}\n{result}")
        return result

    def request_close(self) -> None:
        try:
            self.conn.send(("close", ()))
        except (OSError, ValueError):
            pass

    def join(self) -> None:
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def shutdown(workers: list) -> None:
    """Ask every worker to close, then wait for each (they close in parallel)."""
    for w in workers:
        w.request_close()
    for w in workers:
        w.join()


def worker_main(conn, make_runner: Callable, spec) -> None:
    # The parent handles Ctrl-C and stop requests and closes us (a stop signal to the whole
    # process group must not kill the env under an actor that is still finishing its segment).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    torch.set_num_threads(1)                       # tiny tensors; threads would only contend
    try:
        runner = make_runner(spec)
        conn.send((True, runner.info))
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):            # the parent is gone
                break
            if method == "close":
                break
            try:
                conn.send((True, getattr(runner, method)(*args)))
            except Exception:
                conn.send((False, traceback.format_exc()))
    finally:
        runner.close()
