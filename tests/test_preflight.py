"""Checks before any rank starts (launch/preflight.py): a bad pretrained directory, CURVE keys or a
port another process holds stop `asyncvla train` in about a second with one line naming the key,
instead of a rank's traceback after DeepSpeed's start-up; `asyncvla config` refuses the same paths."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncvla.launch import preflight
from asyncvla.common.config import load_config
from tests.support.paths import MANISKILL, PIXEL
from tests.support.ports import run_port_overrides

CONFIG = str(PIXEL)


def cli(*args, timeout=120):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", *args], capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - t0


def test_pretrained_directory_problems_name_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (other / "model.safetensors").write_bytes(b"")
    (other / "tokenizer.json").write_text("{}")
    for path, words in ((tmp_path / "nope", "no such directory"), (tmp_path / "empty", "config.json"),
                        (other, "holds a 'llava' model; supported: idefics3, smolvlm")):
        found = preflight.problems(load_config(CONFIG, [f"policy.pretrained_path={path}"]), ports=False)
        assert len(found) == 1 and "policy.pretrained_path=" in found[0] and words in found[0], found


def recorded_run(tmp_path, cfg) -> Path:
    """A run directory whose one complete checkpoint records `cfg` (as the learner's save does)."""
    import torch

    from asyncvla.common.config import to_dict
    from asyncvla.learner import checkpoint as ck
    from tests.support.checkpoints import state_tag

    state = {ck.CLIENT_KEY: {"step": 2, "config": to_dict(cfg), "ema": {"shadow": {"w": torch.ones(2)}}}}
    state_tag(tmp_path / "run" / "checkpoints", 2, {"zero_pp_rank_0_mp_rank_00_model_states.pt": state})
    return tmp_path / "run"


def test_a_resume_that_changes_the_flow_experts_shape_is_refused_naming_both_values(tmp_path):
    """policy.flow.* shape keys are structural like the backbone's (declared once on the config
    fields): a flow run resumed with another expert width is refused before any rank starts."""
    flow = ["policy.action_head=flow"]
    run = recorded_run(tmp_path, load_config(CONFIG, flow))
    width = load_config(CONFIG, flow).policy.flow.width
    found = preflight.problems(load_config(CONFIG, [*flow, f"checkpoint.resume={run}",
                                                    f"policy.flow.width={width * 2}"]), ports=False)
    assert len(found) == 1 and found[0].startswith(f"checkpoint.resume='{run}': checkpoint '{run}/checkpoints/"), found
    assert f"policy.flow.width={width} (this config: {width * 2})" in found[0], found
    free = [*flow, f"checkpoint.resume={run}", "learner.lr=0.5", "policy.flow.noise_level=0.3"]
    assert preflight.problems(load_config(CONFIG, free), ports=False) == []        # not structural
    found = preflight.problems(load_config(CONFIG, [f"checkpoint.resume={tmp_path / 'nope'}"]), ports=False)
    assert len(found) == 1 and "checkpoint.resume=" in found[0] and "does not exist" in found[0], found


def test_train_refuses_another_policy_shape_on_resume_before_any_rank_starts(tmp_path):
    run = recorded_run(tmp_path, load_config(CONFIG))
    r, took = cli("train", CONFIG, *run_port_overrides(), "--resume", str(run), "policy.n_bins=16")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("asyncvla: cannot start: checkpoint.resume="), err
    assert f"policy.n_bins={load_config(CONFIG).policy.n_bins} (this config: 16)" in err[0], err
    assert not (run / "policy_init").exists() and not (run / "launch_config.yaml").exists()   # nothing started
    check = "import sys; from asyncvla.launch import preflight; from asyncvla.common.config import load_config; " \
            f"preflight.problems(load_config({CONFIG!r}, ['checkpoint.resume={run}']), ports=False); " \
            "print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout.strip() == "False"
    print(f"refused in {took:.1f} s")


def test_a_camera_or_task_maniskill_lacks_stops_train_and_pipeline_before_any_process_starts(tmp_path):
    """Named in one line by the launcher (a probe of the task without observations), not by an
    actor's traceback after start-up or after minutes of demonstrations."""
    camera = "env.camera='hand_camera' is not a camera of PushCube-v1; its cameras: ['base_camera']"
    for command, prefix, wrong, said in (
            ("train", "asyncvla: cannot start: ", "env.camera=hand_camera", camera),
            ("pipeline", "asyncvla pipeline: cannot start: ", "env.camera=hand_camera", camera),
            ("train", "asyncvla: cannot start: ", "env.id=PushCube-v9", "env.id='PushCube-v9' is not a ManiSkill3 task")):
        r, took = cli(command, str(MANISKILL), *run_port_overrides(), f"logging.output_dir={tmp_path}", wrong)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith(prefix + said), r.stderr[-2000:]
        print(f"{command} {wrong}: refused in {took:.1f} s")
    assert not list(tmp_path.iterdir())          # no run directory, no demonstrations: nothing started


def test_a_held_port_stops_train_before_any_rank_starts(tmp_path):
    overrides = run_port_overrides()
    port = int(next(o for o in overrides if o.startswith("transport.weights_port=")).split("=")[1])
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        r, took = cli("train", CONFIG, *overrides, f"logging.output_dir={tmp_path}", "learner.max_steps=1")
    finally:
        holder.close()
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert err == [e for e in err if e.startswith("asyncvla: cannot start: ")] and len(err) == 1, err
    assert f"transport.weights_port={port}" in err[0] and "in use" in err[0].lower(), err
    assert not (tmp_path / "pixel_task" / "checkpoints").exists()        # nothing was started
    print(f"refused in {took:.1f} s")


def test_the_same_port_twice_and_missing_keys_are_refused(tmp_path):
    cfg = load_config(CONFIG, ["transport.control_port=6001", "transport.weights_port=6001",
                               f"transport.keys_dir={tmp_path}"])
    found = preflight.problems(cfg)
    assert any("transport.weights_port=6001: the same port as transport.control_port" in f for f in found), found
    assert any("transport.keys_dir=" in f and "asyncvla keygen" in f for f in found), found


def test_config_command_refuses_a_bad_path_and_notes_a_busy_port(tmp_path):
    r, _ = cli("config", CONFIG, f"policy.pretrained_path={tmp_path / 'nope'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"asyncvla: config error: policy.pretrained_path='{tmp_path / 'nope'}': no such directory"]
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        r, _ = cli("config", CONFIG, f"launch.master_port={port}")
    finally:
        holder.close()
    assert r.returncode == 0 and f"note: launch.master_port={port}" in r.stderr, r.stderr


def test_a_checkpoints_path_that_is_a_file_stops_train_before_anything_is_written(tmp_path):
    run = tmp_path / "pixel_task"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")
    r, took = cli("train", CONFIG, *run_port_overrides(), f"logging.output_dir={tmp_path}", "learner.max_steps=1")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("asyncvla: cannot start: "), r.stderr[-2000:]
    assert f"{run / 'checkpoints'} is a file, not a directory" in err[0] and "logging.output_dir" in err[0], err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]       # no launch_config.yaml, no rank started
    # the same for a run directory that is a file, from `asyncvla config` too
    (tmp_path / "taken").write_text("")
    r, _ = cli("config", CONFIG, f"logging.output_dir={tmp_path}", "logging.experiment_name=taken")
    assert r.returncode == 2 and f"{tmp_path / 'taken'} is a file, not a directory" in r.stderr, r.stderr
    print(f"refused in {took:.1f} s")
