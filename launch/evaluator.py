"""Periodic evaluation beside training: a process that follows the published weights.

    python -m asyncvla.launch.evaluator RUN_DIR/launch_config.yaml      (started by `asyncvla train`)

It evaluates the published (EMA) policy whenever the learner's step passes a multiple of
`eval.eval_interval`, and once more at the last step; the summaries and videos go to
RUN_DIR/eval/step_N/ and eval/success_rate, eval/return, eval/length to tensorboard. Running it as
its own process keeps env rollouts out of the learner's loop and the learner free of env code.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from asyncvla.actors.evaluate import format_summary, periodic_eval
from asyncvla.common.config import TransportConfig, load_config
from asyncvla.common.policy import VLAPolicy
from asyncvla.common.signals import stop_on_signals
from asyncvla.common.weight_channel import WeightSubscriber

log = logging.getLogger("asyncvla.evaluator")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncvla.launch.evaluator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the run's resolved config (RUN_DIR/launch_config.yaml)")
    p.add_argument("--run-dir", help="default: the config file's folder")
    p.add_argument("--host", default="127.0.0.1", help="host of the learner's weight server")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s evaluator %(levelname)s %(message)s")
    cfg = load_config(args.config)
    return run(cfg, Path(args.run_dir or Path(args.config).parent), args.host)


def run(cfg, run_dir: Path, host: str) -> int:
    from torch.utils.tensorboard import SummaryWriter

    stop = stop_on_signals()
    torch.set_num_threads(1)
    interval, last_step = cfg.eval.eval_interval, cfg.learner.max_steps
    policy_dir = run_dir / "policy_init"
    while not (policy_dir / "policy.json").exists():       # written by the learner at start-up
        if stop.wait(0.5):
            return 0
    policy = VLAPolicy.from_pretrained(policy_dir)
    weights = WeightSubscriber(f"tcp://{host}:{cfg.transport.weights_port}",
                               TransportConfig(keys_dir=cfg.transport.keys_dir))
    writer = SummaryWriter(str(run_dir / "tb"))
    next_step = interval
    try:
        while not stop.is_set():
            got = weights.wait_newer(-1, timeout=1.0)
            if got is None:
                continue
            version, tensors = got
            step = version * cfg.learner.publish_interval
            if step < min(next_step, last_step):
                continue
            policy.load_trainable_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
            t0 = time.perf_counter()
            summary = periodic_eval(policy, cfg, step, run_dir, writer)
            log.info("step %d (version %d), %.1f s: %s", step, version, time.perf_counter() - t0,
                     format_summary(summary).replace("\n", "; "))
            if step >= last_step:
                break
            next_step = (step // interval + 1) * interval
    finally:
        writer.close()
        weights.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
