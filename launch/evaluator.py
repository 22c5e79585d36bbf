"""Periodic evaluation beside training: an actor-side process that follows the published weights.

    python -m asyncvla.launch.evaluator --learner tcp://HOST:PORT --run-dir RUN   (started by `asyncvla train`)

It joins the learner as an actor does (actors/join.py: config, policy and weights from the
welcome) but sends no trajectories. It evaluates the published (EMA) policy whenever the
learner's step — which the weight server sends with each version — passes a multiple of
`eval.eval_interval`, and once more on the last weights when training ends (by any budget).
Summaries and videos go to RUN/eval/step_N/; eval/success_rate, eval/return, eval/length to
tensorboard in RUN/tb. Running it as its own process keeps env rollouts out of the learner's loop.
An evaluator that has not joined when the learner's end record appears in the run dir (a run
shorter than the evaluator's start-up, or an evaluator restarted at the end) evaluates the final
checkpoint's published weights from disk instead: the last evaluation is never lost to a race.
Exit code: 0 once the last weights are evaluated, 128 + N when stopped by signal N (mid-evaluation
too: without a traceback), 1 on an error (`asyncvla train` restarts it once).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

from asyncvla.actors.evaluate import format_summary, periodic_eval
from asyncvla.actors.join import join
from asyncvla.common.transport.auth import join_secret_from_env
from asyncvla.common.config import TransportConfig
from asyncvla.common.transport.control import BYE_HOLD_MAX_S, EVALUATOR_PREFIX
from asyncvla.common.rundir import LEARNER_END, read_end
from asyncvla.common.signals import stop_on_signals

log = logging.getLogger("asyncvla.evaluator")
# At the end of training, for the last published version's weights (the learner serves them
# until this evaluator's bye, which waits for them at most BYE_HOLD_MAX_S).
LAST_WEIGHTS_WAIT_S = BYE_HOLD_MAX_S + 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncvla.launch.evaluator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learner", required=True, metavar="tcp://HOST:PORT", help="the learner's control endpoint")
    p.add_argument("--run-dir", required=True, help="where eval/ and tb/ go (the run directory)")
    p.add_argument("--keys-dir", help="CURVE keys made by `asyncvla keygen` (client side)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s evaluator %(levelname)s %(message)s")
    return run(args.learner, Path(args.run_dir), TransportConfig(keys_dir=args.keys_dir))


def run(learner: str, run_dir: Path, tcfg) -> int:
    from asyncvla.common.trackers import open_trackers

    stop = stop_on_signals()
    torch.set_num_threads(1)
    joined = join(learner, f"{EVALUATOR_PREFIX}{socket.gethostname()}-{os.getpid()}", tcfg,
                  _StopOrEnded(stop, run_dir), join_secret=join_secret_from_env(), defer_bye=True)
    if joined is None:
        return stop.exit_code() if stop.is_set() else evaluate_final_checkpoint(run_dir, stop)
    cfg, policy, weights = joined.cfg, joined.policy, joined.weights
    interval, last_step = cfg.eval.eval_interval, cfg.learner.max_steps
    writer = open_trackers(cfg, run_dir, "evaluator")
    next_step, version, latest = interval, -1, None     # latest: (step, tensors) not yet evaluated
    waited_for_last = False
    try:
        while not stop.is_set():
            got = weights.wait_newer(version, timeout=1.0)
            if got is not None:
                version, tensors = got
                latest = (weights.step, tensors)          # the learner sends each version's step
            finished = joined.client.finished
            if finished and not waited_for_last:
                version, latest = _wait_for_last_version(weights, joined.client.final_version, version, latest, stop)
                joined.client.say_bye()   # (only now may the learner close its weight server)
                waited_for_last = True
            if latest is not None and (latest[0] >= min(next_step, last_step) or finished):
                step, tensors = latest
                latest = None
                policy.load_trainable_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
                if not _evaluate(policy, cfg, step, run_dir, writer, stop, f"version {version}"):
                    break
                if step >= last_step:
                    break
                next_step = (step // interval + 1) * interval
            if finished and latest is None:
                break
    finally:
        writer.close()
        joined.close()
    return stop.exit_code()


class _StopOrEnded:
    """What ends the evaluator's wait to join: a signal, or the learner's end record (training
    ended before this evaluator joined, and no learner will answer its hello)."""

    def __init__(self, stop, run_dir: Path):
        self.stop, self.end_record = stop, run_dir / LEARNER_END

    def is_set(self) -> bool:
        return self.stop.is_set() or self.end_record.exists()


def evaluate_final_checkpoint(run_dir: Path, stop) -> int:
    """The learner ended before this evaluator joined: evaluate the final checkpoint's published
    (EMA) weights, which are the last version the evaluator would have been sent, at its step.
    Nothing to do when the learner was stopped or failed (the launcher stops the evaluator then)."""
    from asyncvla.common.config import from_dict
    from asyncvla.common.trackers import open_trackers
    from asyncvla.learner.checkpoint import recorded_config
    from asyncvla.learner.export import load_checkpoint

    end = read_end(run_dir) or {}
    if end.get("reason") != "budget" or not end.get("checkpoint"):
        log.info("the learner ended (%s) before this evaluator joined; nothing to evaluate", end.get("reason"))
        return 0
    tag, step = end["checkpoint"], end["checkpoint_step"]
    log.info("the learner finished at step %d before this evaluator joined; evaluating its final "
             "checkpoint %s", step, tag)
    cfg = from_dict(recorded_config(tag))
    policy, cfg, _ = load_checkpoint(tag, weights="ema", device=cfg.actor.device)
    writer = open_trackers(cfg, run_dir, "evaluator")
    try:
        _evaluate(policy, cfg, step, run_dir, writer, stop, "final checkpoint")
    finally:
        writer.close()
    return stop.exit_code()


def _evaluate(policy, cfg, step: int, run_dir: Path, writer, stop, source: str) -> bool:
    """`periodic_eval` at `step`, logged with `source` (what the weights are); False when a stop
    ended it (a stop can end the env workers under it)."""
    t0 = time.perf_counter()
    try:
        summary = periodic_eval(policy, cfg, step, run_dir, writer)
    except Exception as e:
        if not stop.is_set():
            raise
        log.info("stopped during the evaluation of step %d (%s)", step, str(e).splitlines()[0])
        return False
    log.info("step %d (%s), %.1f s: %s", step, source, time.perf_counter() - t0,
             format_summary(summary).replace("\n", "; "))
    return True


def _wait_for_last_version(weights, last_version: int, version: int, latest, stop):
    """(version, latest) once the learner's last published version has arrived, or after
    LAST_WEIGHTS_WAIT_S. It is published before "shutdown", but the weights travel on their own
    channel, so they can come after it."""
    deadline = time.monotonic() + LAST_WEIGHTS_WAIT_S
    while version < last_version and not stop.is_set() and time.monotonic() < deadline:
        got = weights.wait_newer(version, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if got is not None:
            version, tensors = got
            latest = (weights.step, tensors)
    if version < last_version:
        log.warning("the learner's last version %d did not arrive within %.0f s; evaluating version %d",
                    last_version, LAST_WEIGHTS_WAIT_S, version)
    return version, latest


if __name__ == "__main__":
    sys.exit(main())
