"""Metric backends (logging.backends): tensorboard always at hand, wandb and swanlab as optional extras.

    trackers = open_trackers(cfg, run_dir, job="learner")    # None of them on ranks > 0: pass nothing
    trackers.add_scalar("train/actor/policy_loss", 0.12, step)
    trackers.add_text("config", yaml_text); trackers.add_video("eval/video", path, step); trackers.close()

The same scalar names go to every backend. tensorboard writes RUN/tb. wandb and swanlab get one run
per process (the learner, the evaluator, SFT), grouped under logging.experiment_name, with the
whole config logged once when it starts; their local files sit in RUN/wandb and RUN/swanlab.
Videos go to the backends that take them (wandb, swanlab); tensorboard's need moviepy and a GIF
re-encode, so it gets none.

A backend that cannot start (not installed, or online without a key) is reported by `problems`,
which `asyncvla train` / `sft` / `pipeline` run before anything starts: one line saying how to fix
it. logging.tracker_mode=offline keeps wandb and swanlab on local files (`wandb sync`,
`swanlab sync` upload them later).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BACKENDS = ("tensorboard", "wandb", "swanlab")
EXTRAS = {"wandb": "pip install wandb (or pip install -e .[wandb])",
          "swanlab": "pip install swanlab (or pip install -e .[swanlab])"}


def problems(cfg) -> list[str]:
    """Why a backend of logging.backends could not start here, one line each ([]: all can)."""
    out = []
    for name in cfg.logging.backends:
        if name == "tensorboard":
            continue
        if importlib.util.find_spec(name) is None:
            out.append(f"logging.backends: {name} is not installed: {EXTRAS[name]}, or drop it from "
                       "logging.backends")
        elif cfg.logging.tracker_mode == "online" and not _has_key(name):
            how = "run `wandb login` or set WANDB_API_KEY" if name == "wandb" else \
                "run `swanlab login` or set SWANLAB_API_KEY"
            out.append(f"logging.backends: {name} has no API key for logging.tracker_mode=online: {how}, "
                       "or set logging.tracker_mode=offline (local files; upload them later)")
    return out


def _has_key(name: str) -> bool:
    if name == "wandb":
        if os.environ.get("WANDB_API_KEY"):
            return True
        import netrc
        try:
            hosts = netrc.netrc().hosts
        except (OSError, netrc.NetrcParseError):
            return False
        return any("wandb" in host for host in hosts)
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    return (Path.home() / ".swanlab" / ".netrc").is_file()


class Trackers:
    """Every backend of logging.backends behind SummaryWriter's calls."""

    def __init__(self, backends: list):
        self.backends = backends

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for b in self.backends:
            b.add_scalar(tag, value, step)

    def add_scalars(self, values: dict, step: int) -> None:
        """Several scalars of one step (one wandb/swanlab log call)."""
        for b in self.backends:
            b.add_scalars(values, step)

    def add_text(self, tag: str, text: str) -> None:
        for b in self.backends:
            b.add_text(tag, text)

    def add_video(self, tag: str, path, step: int) -> None:
        for b in self.backends:
            b.add_video(tag, Path(path), step)

    def flush(self) -> None:
        for b in self.backends:
            b.flush()

    def close(self) -> None:
        for b in self.backends:
            b.close()


def open_trackers(cfg, run_dir, job: str, tb_dir=None) -> Trackers:
    """The backends of logging.backends for this process (`job`: learner, evaluator, sft), writing
    under run_dir (tensorboard: tb_dir, default run_dir/tb)."""
    from asyncvla.common.config import to_dict
    run_dir = Path(run_dir)
    made = []
    for name in cfg.logging.backends:
        if name == "tensorboard":
            made.append(_TensorBoard(Path(tb_dir) if tb_dir is not None else run_dir / "tb"))
        elif name == "wandb":
            made.append(_WandB(cfg, run_dir, job, to_dict(cfg)))
        elif name == "swanlab":
            made.append(_SwanLab(cfg, run_dir, job, to_dict(cfg)))
    return Trackers(made)


class _Backend:
    def add_scalar(self, tag, value, step):
        self.add_scalars({tag: value}, step)

    def add_scalars(self, values, step):
        for k, v in values.items():
            self.add_scalar(k, v, step)

    def add_text(self, tag, text):
        pass

    def add_video(self, tag, path, step):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class _TensorBoard(_Backend):
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(log_dir))

    def add_scalar(self, tag, value, step):
        self.writer.add_scalar(tag, value, step)

    def add_text(self, tag, text):
        self.writer.add_text(tag, text)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.flush()
        self.writer.close()


class _WandB(_Backend):
    def __init__(self, cfg, run_dir: Path, job: str, config: dict):
        import wandb
        self.wandb = wandb
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=cfg.logging.project, name=f"{cfg.logging.experiment_name}-{job}",
                              group=cfg.logging.experiment_name, job_type=job, dir=str(run_dir),
                              config=config, mode=cfg.logging.tracker_mode, reinit="create_new")

    def add_scalars(self, values, step):
        self.run.log(dict(values), step=step)

    def add_text(self, tag, text):
        self.run.summary[tag] = text

    def add_video(self, tag, path, step):
        self.run.log({tag: self.wandb.Video(str(path), format=path.suffix.lstrip("."))}, step=step)

    def close(self):
        self.run.finish()


class _SwanLab(_Backend):
    def __init__(self, cfg, run_dir: Path, job: str, config: dict):
        import swanlab
        self.swanlab = swanlab
        mode = "cloud" if cfg.logging.tracker_mode == "online" else "local"
        self.run = swanlab.init(project=cfg.logging.project, experiment_name=f"{cfg.logging.experiment_name}-{job}",
                                group=cfg.logging.experiment_name, config=config,
                                logdir=str(run_dir / "swanlab"), mode=mode)

    def add_scalars(self, values, step):
        self.run.log(dict(values), step=step)

    def add_text(self, tag, text):
        self.run.log({tag: self.swanlab.Text(text)})

    def add_video(self, tag, path, step):
        video = getattr(self.swanlab, "Video", None)
        if video is not None:
            self.run.log({tag: video(str(path))}, step=step)

    def close(self):
        self.run.finish()
