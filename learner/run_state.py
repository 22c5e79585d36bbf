"""What the learner's loop keeps beside the engine: its state, its saves, and when it ends.

    TrainState     the update count, the weight version served, the env steps consumed, the seconds
                   trained and the value normalisation (the published EMA weights live with
                   publishing: publish.py)
    Checkpointer   periodic and final saves on the branch the run stands on, their failures, the
                   segment accounting written with each, and the end record the launcher reads
    Budget         when the run ends: a stop signal on any rank, learner.max_steps, max_time_s,
                   max_env_steps, or learner.target_success held (every rank reaches one verdict)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from asyncvla.common.config import Config, to_dict
from asyncvla.common.rundir import LEARNER_END, write_end
from asyncvla.learner import checkpoint
from asyncvla.learner.collectives import any_rank
from asyncvla.learner.metrics import TargetWatch, write_accounting
from asyncvla.learner.value_norm import ValueNorm

log = logging.getLogger("asyncvla.learner")


@dataclass
class TrainState:
    step: int = 0                       # updates done
    version: int = 0                    # the newest weight version published
    env_steps: int = 0                  # env steps of the segments received (the run's total)
    time_s: float = 0.0                 # seconds trained (the run's total: a resumed run adds to it)
    value_norm: ValueNorm | None = None

    def saved(self, cfg: Config, ema_state: dict | None) -> dict:
        """What a checkpoint's client_state holds of the run (checkpoint.save adds every rank's RNG)."""
        return {"step": self.step, "version": self.version, "env_steps": self.env_steps, "time_s": self.time_s,
                "config": to_dict(cfg), "ema": ema_state,
                "value_norm": self.value_norm.state_dict() if self.value_norm else None}

    def load(self, saved: dict) -> None:
        """Take the run's counts and statistics from a checkpoint's client_state (what `saved` wrote)."""
        self.step, self.version, self.env_steps = saved["step"], saved["version"], saved["env_steps"]
        self.time_s = saved.get("time_s", 0.0)           # (none in a checkpoint from before it was kept)
        if self.value_norm is not None and saved.get("value_norm"):   # (none in a run saved without it: start anew)
            self.value_norm.load_state_dict(saved["value_norm"])


class Checkpointer:
    """The run's checkpoints. `saved_at` / `saved_tag`: the step and tag of the newest one of the
    branch this run trains (a resumed run's: the one it resumed from until it saves), which the
    end record names. A failed periodic save is counted (`failures`) and training goes on."""

    def __init__(self, engine, run_dir: Path, cfg: Config, resume_from: Path | None, start_step: int, link=None):
        self.engine, self.run_dir, self.cfg, self.link = engine, run_dir, cfg, link
        self.saved_at, self.saved_tag, self.failures = start_step, resume_from, 0

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_interval
        return bool(every) and step % every == 0

    def save(self, state: TrainState, ema_state: dict | None, nonfinite_steps: int = 0, final: bool = False) -> bool:
        """Save `state` (a collective), then a periodic save's accounting; False, counted, when it
        could not be written (checkpoint.save logged why)."""
        tag = checkpoint.save(self.engine, self.run_dir, state.step, state.saved(self.cfg, ema_state),
                              keep_last=self.cfg.checkpoint.keep_last, final=final)
        if tag is None:
            self.failures += 1
        else:
            self.saved_at, self.saved_tag = state.step, tag
        if not final:
            self.account(state.step, nonfinite_steps)
        return tag is not None

    def finish(self, ended: str, state: TrainState, nonfinite_steps: int, signum: int | None) -> None:
        """The run's last accounting, then its end record ("budget" for any budget that ended it)."""
        self.account(state.step, nonfinite_steps)
        self.record_end(ended if ended in ("stopped", "failed") else "budget", state.step, signum)

    def account(self, step: int, nonfinite_steps: int) -> None:
        """RUN/accounting/rank_<r>.json: acked = trained + dropped + buffered, and the run's counts."""
        write_accounting(self.run_dir, step, self.link.inbox, self.link.servers, nonfinite_steps=nonfinite_steps,
                         checkpoint_failures=self.failures)

    def record_end(self, reason: str, step: int, signum: int | None) -> None:
        """The end record (rank 0, last): how the run ended and the checkpoint to continue from."""
        if dist.get_rank() != 0:
            return
        try:
            write_end(self.run_dir, reason, step, self.saved_tag, None if self.saved_tag is None else self.saved_at,
                      signum)
        except OSError as e:                 # (the launcher then cannot call it a finish: it says so)
            log.error("the run's end record %s was not written: %s", self.run_dir / LEARNER_END, e)


class Budget:
    """When the run ends. `stopped()` is a collective: a signal on one rank stops every rank at the
    same update boundary. `spent(state, report)` (every rank, after the update's report, which
    every rank shares) says which budget ended it, or None: learner.max_steps, max_time_s, max_env_steps,
    or learner.target_success held over two windows in a row. Like the update and env-step counts,
    the seconds are the run's: a resumed run counts on from the checkpoint's (so it trains for what
    is left of learner.max_time_s), and this process's count starts at `start`."""

    def __init__(self, cfg: Config, stop, device):
        self.cfg, self.stop, self.device = cfg, stop, device
        self.target = TargetWatch(cfg.learner.target_success, cfg.learner.target_success_episodes)
        self.before, self.started = 0.0, time.perf_counter()
        self.signalled = False

    def start(self, state: TrainState) -> None:
        self.before, self.started = state.time_s, time.perf_counter()

    def elapsed(self) -> float:
        """Seconds trained: the checkpoint's, if resumed, and this process's since `start`."""
        return self.before + time.perf_counter() - self.started

    def time_up(self) -> bool:
        lc = self.cfg.learner
        return bool(lc.max_time_s) and self.elapsed() >= lc.max_time_s

    def stopped(self) -> bool:
        self.signalled = any_rank(self.stop.is_set(), self.device)
        return self.signalled

    def spent(self, state: TrainState, report: dict | None = None) -> str | None:
        lc = self.cfg.learner
        if state.step >= lc.max_steps:
            return "updates"
        if report is None:
            return None
        if report["time_up"]:
            return "time"
        if lc.max_env_steps and state.env_steps >= lc.max_env_steps:
            return "env steps"
        if self.target.update(report.get("env/episode_success_window"), int(report["env/episodes"])):
            log.info("target reached: success held at or above learner.target_success=%s over two windows of "
                     "%d+ episodes in a row (the newest: %.0f %%)", lc.target_success,
                     lc.target_success_episodes, 100 * report["env/episode_success_window"])
            return "target"
        return None
