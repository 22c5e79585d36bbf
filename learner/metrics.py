"""The one place that logs: tensorboard scalars grouped by source, and the console progress line.

Groups: train/actor/* (policy side of the loss), train/critic/* (value side), env/* (episodes),
rollout/* (data as it arrived: rewards, policy lag), time/* (throughput and where time went),
system/* (actors, drops, memory).

Every rank counts what it received and computes its own loss statistics; once per update
`Metrics.report` combines them over ranks with one collective (a fixed-size vector per rank) and
rank 0 writes. Between reports a rank holds a fixed set of sums, so nothing grows on any rank.

At each checkpoint and at the end, `write_accounting` writes where every segment a rank acked
went (RUN/accounting/rank_<r>.json, see learner/ingest.py) and, on rank 0, what the control and
weight servers refused, by reason.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist

# Where each loss statistic belongs.
GROUPS = {
    "policy_loss": "train/actor", "entropy": "train/actor", "approx_kl": "train/actor",
    "clip_fraction": "train/actor", "ratio_mean": "train/actor", "ratio_max": "train/actor",
    "rho_mean": "train/actor", "rho_clipped_fraction": "train/actor", "grad_norm": "train/actor",
    "lr": "train/actor", "behav_approx_kl": "train/actor", "behav_clip_fraction": "train/actor",
    "value_loss": "train/critic", "explained_variance": "train/critic", "poisoned_columns": "system",
}

# How a scalar combines over ranks: summed counts, maxima; everything else is the ranks' mean.
SUMMED = ("segments", "lag_sum", "episodes", "return_sum", "length_sum", "success_sum", "env_steps",
          "retried", "retried_success",
          "dropped_stale", "dropped_future_version", "dropped_duplicate", "dropped_invalid", "dropped_banned",
          "system/seq_gaps", "system/poisoned_columns")
# (every rank sees the same skipped steps and failed saves: the ranks agree on both)
MAXED = ("lag_max", "train/actor/ratio_max", "actors_seen", "time_up", "system/nonfinite_steps",
         "system/checkpoint_failures")
TASK_COUNTERS = ("task_episodes/", "task_success/")     # + a task's index; summed over ranks
ACCOUNTING_DIR = "accounting"

log = logging.getLogger("asyncvla.learner")


def group(stats: dict) -> dict:
    """Prefix loss statistics with their group; keys that already carry a group are kept."""
    return {(k if "/" in k else f"{GROUPS.get(k, 'train')}/{k}"): v for k, v in stats.items()}


def reduce_over_ranks(values: dict[str, float], device=None) -> dict[str, float]:
    """Combine each rank's scalars with ONE collective: keys in SUMMED are summed, in MAXED take
    the maximum, the rest the mean over ranks. Every rank must pass the same keys."""
    keys = sorted(values)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {k: float(values[k]) for k in keys}
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    table = torch.stack(rows).cpu().numpy()              # [ranks, keys]
    out = {}
    for j, k in enumerate(keys):
        col = table[:, j]
        out[k] = float(col.sum() if k in SUMMED or k.startswith(TASK_COUNTERS) else col.max() if k in MAXED
                       else col.mean())
    return out


class Metrics:
    """Per-rank counters of received data, combined over ranks once per update; rank 0 (the one
    given the trackers: common/trackers.py, tensorboard and what else logging.backends names) writes
    them and the progress bar."""

    def __init__(self, trackers, progress_total: int, show_progress: bool, start_step: int = 0,
                 env_steps: int = 0, eval_dir: Path | None = None, success_window: int = 128,
                 task_names: tuple = ()):
        self.writer = trackers
        self.task_names = tuple(task_names) if len(task_names) > 1 else ()   # (one task: env/* says it all)
        self.success_window = success_window
        self.recent: collections.deque = collections.deque()   # (episodes, successes) of the newest updates
        self.bar = None
        self.eval_dir = eval_dir            # the periodic evaluator's summaries, shown on the bar
        self._eval_seen = None
        if trackers is not None:
            if show_progress:
                from tqdm import tqdm
                self.bar = tqdm(total=progress_total, initial=start_step, unit="upd",
                                dynamic_ncols=True, mininterval=1.0)
        self.env_steps = env_steps          # all ranks, since the run began (kept in checkpoints)
        self.last: dict = {}
        self._t_last = time.perf_counter()
        self._retries = False               # any retried start seen (env.retry_failed_starts)
        self._reset()

    def _reset(self) -> None:
        self.counts = dict.fromkeys(("segments", "lag_sum", "lag_max", "episodes", "return_sum",
                                     "length_sum", "success_sum", "env_steps", "retried",
                                     "retried_success"), 0.0)
        for i in range(len(self.task_names)):
            self.counts[f"task_episodes/{i}"] = self.counts[f"task_success/{i}"] = 0.0
        self.actors: set[str] = set()       # ids seen since the last report (as many as actors)

    # ------------------------------------------------------------------ collected as data arrives
    def add_segment(self, segment, lag: int) -> None:
        a, c = segment.arrays, self.counts
        c["segments"] += 1
        c["lag_sum"] += lag
        c["lag_max"] = max(c["lag_max"], lag)
        c["episodes"] += len(a["ep_return"])
        # float64 sums: a float32 one overflows to inf, an int64 one wraps round to a plausible value
        c["return_sum"] += float(a["ep_return"].sum(dtype=np.float64))
        c["length_sum"] += float(a["ep_length"].sum(dtype=np.float64))
        c["success_sum"] += float(a["ep_success"].sum(dtype=np.float64))
        if self.task_names:
            n = len(self.task_names)
            episodes = np.bincount(a["ep_task"], minlength=n)
            successes = np.bincount(a["ep_task"], weights=a["ep_success"].astype(np.float64), minlength=n)
            for i in range(n):
                c[f"task_episodes/{i}"] += float(episodes[i])
                c[f"task_success/{i}"] += float(successes[i])
        c["env_steps"] += int(segment.meta["env_steps"])
        retried = min(int(segment.meta.get("ep_retried", 0)), len(a["ep_return"]))
        c["retried"] += retried
        c["retried_success"] += min(int(segment.meta.get("ep_retried_success", 0)), retried)
        self.actors.add(segment.meta["actor_id"])

    # --------------------------------------------------------------------------- once an update
    def report(self, step: int, scalars: dict, drops: dict, samples: int, device=None,
               time_up: bool = False, rank0_only: dict | None = None) -> dict:
        """Combine this update's figures over ranks (a collective: every rank calls it, with the
        same `scalars` keys) and log them on rank 0, with `rank0_only` (figures only rank 0 has).
        Returns the combined scalars ("rollout/env_steps" is the run's total, "time_up" is 1 if
        any rank's time budget ran out)."""
        local = {**self.counts, **{f"dropped_{k}": v for k, v in drops.items()},
                 "actors_seen": len(self.actors), "time_up": float(time_up), **scalars}
        total = reduce_over_ranks(local, device)
        self._reset()
        new_env_steps = int(total.pop("env_steps"))
        self.env_steps += new_env_steps
        out = {k: v for k, v in total.items() if k not in self.counts and not k.startswith("dropped_")}
        for i, name in enumerate(self.task_names):        # env.tasks: each task's episodes and success
            n_task = total[f"task_episodes/{i}"]
            out[f"env/episodes/{name}"] = n_task
            if n_task:
                out[f"env/success/{name}"] = total[f"task_success/{i}"] / n_task
        out.pop("actors_seen")
        n_seg, n_ep = total["segments"], total["episodes"]
        if n_seg:
            out["rollout/policy_lag_mean"] = total["lag_sum"] / n_seg
            out["rollout/policy_lag_max"] = total["lag_max"]
        out["env/episodes"] = n_ep
        if n_ep:
            for name in ("return", "length", "success"):
                out[f"env/episode_{name}"] = total[f"{name}_sum"] / n_ep
            self.recent.append((n_ep, total["success_sum"]))
            self._retries |= total["retried"] > 0
            if self._retries:       # env.retry_failed_starts: the share of retries, fresh starts' success
                out["env/retried_share"] = total["retried"] / n_ep
                fresh = n_ep - total["retried"]
                out["env/fresh_episode_success"] = ((total["success_sum"] - total["retried_success"]) / fresh
                                                    if fresh else None)
            windowed = windowed_success(self.recent, self.success_window)
            if windowed is not None:
                out["env/episode_success_window"] = windowed
        out["system/actors_contributing"] = total["actors_seen"]      # the most any rank heard from
        out.update({f"system/{k}": v for k, v in total.items() if k.startswith("dropped_")})
        out["rollout/env_steps"] = self.env_steps
        out.update(rank0_only or {})
        self._write(step, out, samples, new_env_steps)
        return out

    def _write(self, step: int, out: dict, samples: int, env_steps: int) -> None:
        now = time.perf_counter()
        dt = max(now - self._t_last, 1e-9)
        self._t_last = now
        out["time/samples_per_s"] = samples / dt
        out["time/env_steps_per_s"] = env_steps / dt
        self.last = out
        if self.writer is None:
            return
        out["system/rss_gb"] = psutil.Process().memory_info().rss / 2**30
        self.writer.add_scalars({k: v for k, v in out.items()
                                 if k != "time_up" and v is not None and np.isfinite(v)}, step)
        self.writer.flush()        # an update takes seconds: flushing each one loses nothing on a crash
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            sr = out.get("env/episode_success")
            ev = self._latest_eval()
            self.bar.set_postfix_str(
                f"env_steps={self.env_steps} success={'-' if sr is None else f'{sr:.0%}'} "
                + ("" if ev is None else f"eval={ev} ")
                + f"samples/s={out['time/samples_per_s']:.0f} lag={out.get('rollout/policy_lag_mean', 0):.1f}",
                refresh=False)

    def _latest_eval(self) -> str | None:
        """The periodic evaluator's newest figure (RUN/eval/step_N/summary.json) as `62%@300`: on
        fixed episodes, it says more than the few training episodes an update sees."""
        if self.eval_dir is None or not self.eval_dir.is_dir():
            return None
        if self._eval_seen is None or time.monotonic() - self._eval_seen[0] > 5.0:     # a glob every 5 s
            done = sorted(self.eval_dir.glob("step_*/summary.json"))
            self._eval_seen = (time.monotonic(), done[-1] if done else None)
        path = self._eval_seen[1]
        if path is None:
            return None
        try:
            s = json.loads(path.read_text())
            return f"{s['success_rate']:.0%}@{s['step']}"
        except (OSError, ValueError, KeyError):
            return None

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def windowed_success(recent: collections.deque, n: int) -> float | None:
    """Success rate over the newest whole updates holding at least `n` episodes (None until that
    many were seen). `recent` holds (episodes, successes) per update, oldest first; updates older
    than the window are dropped from it, so it never grows."""
    while len(recent) > 1 and sum(e for e, _ in recent) - recent[0][0] >= n:
        recent.popleft()
    episodes = sum(e for e, _ in recent)
    return sum(s for _, s in recent) / episodes if episodes >= n else None


class TargetWatch:
    """learner.target_success: reached once the windowed success has stayed at or above the target
    while a whole further window of episodes arrived, i.e. over two disjoint windows in a row. A
    single crossing is often luck: a run stopped on it evaluated below the target."""

    def __init__(self, target: float | None, window: int):
        self.target, self.window = target, window
        self.held: int | None = None        # episodes since the window reached the target (None: below)

    def update(self, windowed: float | None, new_episodes: int) -> bool:
        if self.target is None or windowed is None or windowed < self.target:
            self.held = None
            return False
        self.held = 0 if self.held is None else self.held + new_episodes
        return self.held >= self.window


def write_accounting(run_dir, step: int, inbox, servers=(), **counts) -> Path:
    """RUN/accounting/rank_<r>.json: this learner process's segment accounting (`Inbox.accounting`:
    acked = trained + dropped + buffered) at `step`, `counts` (the run's non-finite steps skipped,
    saves failed), and on rank 0 the servers' figures (requests refused by reason, the actor
    registry). Replaced whole (a reader never sees half a file);
    a resumed run starts its counts afresh. Logged too; a write that fails is only logged."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    record = {"rank": rank, "step": step, "pid": os.getpid(), "time": time.time(), **inbox.accounting(), **counts}
    if servers:
        control, weights = servers
        record["control"] = {"messages": control.stats["messages"], "invalid": dict(control.stats["invalid"]),
                             "registry": control.counts()}
        record["weights"] = {**{k: v for k, v in weights.stats.items() if k != "invalid"},
                             "invalid": dict(weights.stats["invalid"])}
    path = Path(run_dir) / ACCOUNTING_DIR / f"rank_{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("segment accounting not written to %s: %s", path, e)
    d = record["dropped"]
    log.info("segments (rank %d, step %d): acked %d = trained %d + dropped %d (invalid %d, stale %d, "
             "future_version %d, duplicate %d, banned %d) + buffered %d%s; %d missing from the actors' sequences",
             rank, step, record["acked"], record["trained"], sum(d.values()), d["invalid"], d["stale"],
             d["future_version"], d["duplicate"], d["banned"], record["buffered"],
             "" if record["balanced"] else "  UNBALANCED", record["seq_gaps"])
    return path
