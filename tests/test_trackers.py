"""Metric backends (common/trackers.py): a real `asyncvla train` logging to tensorboard and wandb
(offline) at once, the wandb runs read back from their local files; a backend that cannot start
stops the run before anything starts, in one line saying how to fix it."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.paths import PIXEL, REPO
from tests.support.ports import run_port_overrides
from tests.support.runs import SMALL

TRACKED_RUN = [*SMALL, "launch.num_local_actors=1", "logging.progress=false"]


def train(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", str(PIXEL),
                           *TRACKED_RUN, f"logging.output_dir={tmp_path}", "logging.experiment_name=run",
                           *run_port_overrides(), *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=400, env=env)


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of a wandb run file (.wandb): wandb's log format, 32 KiB blocks of
    chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:              # (a block's tail too short for a header is padding)
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            records.append(rec)
            part = b""
    return records


def history(records) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is a dev dependency")
def test_wandb_offline_gets_the_same_scalars_as_tensorboard_the_config_once_and_eval_videos(tmp_path):
    r = train(tmp_path, "logging.backends=[tensorboard,wandb]", "logging.tracker_mode=offline",
              "learner.max_steps=3", "eval.eval_interval=3", "eval.num_episodes=2", "eval.save_video=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    run = tmp_path / "run"
    runs = {}
    for d in (run / "wandb").glob("offline-run-*"):
        records = wandb_records(d)
        job = next(r.run.job_type for r in records if r.WhichOneof("record_type") == "run")
        runs[job] = records
    assert set(runs) == {"learner", "evaluator"}, sorted(runs)

    learner = history(runs["learner"])
    assert [h["_step"] for h in learner] == [1, 2, 3]
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    for tag in ("train/actor/policy_loss", "rollout/env_steps", "time/samples_per_s"):
        mine = [(h["_step"], h[tag]) for h in learner]
        theirs = [(e.step, e.value) for e in tb.Scalars(tag)]
        assert [s for s, _ in mine] == [s for s, _ in theirs], tag
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(mine, theirs)), tag

    configs = [r for r in runs["learner"] if r.WhichOneof("record_type") == "run"]
    assert len(configs) == 1
    config = {i.key: json.loads(i.value_json) for i in configs[0].run.config.update}
    assert config["policy"]["n_bins"] == 32 and config["learner"]["max_steps"] == 3

    evaluation = history(runs["evaluator"])
    final = next(h for h in evaluation if "eval/success_rate" in h)
    assert final["_step"] == 3 and 0.0 <= final["eval/success_rate"] <= 1.0
    video = next(h for h in evaluation if h.get("eval/video/_type") == "video-file")    # (wandb flattens it)
    assert video["_step"] == 3 and video["eval/video/size"] > 0


def test_a_backend_that_cannot_start_stops_the_run_at_start_up_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "SWANLAB_API_KEY")}
    env["HOME"] = str(tmp_path)                      # no ~/.netrc, no saved logins
    r = train(tmp_path, "logging.backends=[tensorboard,swanlab]", env=env)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    if importlib.util.find_spec("swanlab") is None:
        said = "asyncvla: cannot start: logging.backends: swanlab is not installed: pip install swanlab"
    else:
        said = "asyncvla: cannot start: logging.backends: swanlab has no API key"
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), r.stderr
    assert not (tmp_path / "run").exists()           # nothing started, nothing written
    if importlib.util.find_spec("wandb") is not None:
        r = train(tmp_path, "logging.backends=[wandb]", env=env)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0] == ("asyncvla: cannot start: logging.backends: wandb has no API key for "
                            "logging.tracker_mode=online: run `wandb login` or set WANDB_API_KEY, or set "
                            "logging.tracker_mode=offline (local files; upload them later)"), lines[0]
