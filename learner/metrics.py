"""The one place that logs: tensorboard scalars grouped by source, and the console progress line.

Groups: train/actor/* (policy side of the loss), train/critic/* (value side), env/* (episodes),
rollout/* (data as it arrived: rewards, policy lag), time/* (throughput and where time went),
system/* (actors, drops, memory).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import psutil

# Where each loss statistic belongs.
GROUPS = {
    "policy_loss": "train/actor", "entropy": "train/actor", "approx_kl": "train/actor",
    "clip_fraction": "train/actor", "ratio_mean": "train/actor", "ratio_max": "train/actor",
    "rho_mean": "train/actor", "rho_clipped_fraction": "train/actor", "grad_norm": "train/actor",
    "lr": "train/actor", "value_loss": "train/critic", "explained_variance": "train/critic",
}


def group(stats: dict) -> dict:
    """Prefix loss statistics with their group; keys that already carry a group are kept."""
    return {(k if "/" in k else f"{GROUPS.get(k, 'train')}/{k}"): v for k, v in stats.items()}


class Metrics:
    """Accumulates scalars between flushes; rank 0 writes them. Other ranks hold a no-op writer."""

    def __init__(self, log_dir: str | None, progress_total: int, show_progress: bool, start_step: int = 0):
        self.writer = None
        self.bar = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir)
            if show_progress:
                from tqdm import tqdm
                self.bar = tqdm(total=progress_total, initial=start_step, unit="upd",
                                dynamic_ncols=True, mininterval=1.0)
        self.episodes = defaultdict(list)
        self.lags: list[int] = []
        self.t_last = time.perf_counter()
        self.env_steps_last = 0
        self.samples_since = 0

    # ------------------------------------------------------------------ collected as data arrives
    def add_segment(self, arrays: dict, lag: int) -> None:
        self.lags.append(lag)
        self.episodes["return"] += arrays["ep_return"].tolist()
        self.episodes["length"] += arrays["ep_length"].tolist()
        self.episodes["success"] += arrays["ep_success"].astype(float).tolist()

    # --------------------------------------------------------------------------- once an update
    def log(self, step: int, scalars: dict, env_steps: int, samples: int) -> None:
        if self.writer is None:
            return
        self.samples_since += samples
        now = time.perf_counter()
        dt = max(now - self.t_last, 1e-9)
        out = dict(scalars)
        out["time/samples_per_s"] = self.samples_since / dt
        out["time/env_steps_per_s"] = (env_steps - self.env_steps_last) / dt
        out["rollout/env_steps"] = env_steps
        if self.lags:
            out["rollout/policy_lag_mean"] = float(np.mean(self.lags))
            out["rollout/policy_lag_max"] = float(np.max(self.lags))
        for name in ("return", "length", "success"):
            if self.episodes[name]:
                out[f"env/episode_{name}"] = float(np.mean(self.episodes[name]))
        out["system/rss_gb"] = psutil.Process().memory_info().rss / 2**30
        for k, v in out.items():
            if v is not None and np.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()        # an update takes seconds: flushing each one loses nothing on a crash
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            sr = out.get("env/episode_success")
            self.bar.set_postfix_str(
                f"env_steps={env_steps} success={'-' if sr is None else f'{sr:.0%}'} "
                f"samples/s={out['time/samples_per_s']:.0f} lag={out.get('rollout/policy_lag_mean', 0):.1f}",
                refresh=False)
        self.t_last, self.env_steps_last, self.samples_since = now, env_steps, 0
        self.lags.clear()
        self.episodes.clear()
        self.last = out

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
