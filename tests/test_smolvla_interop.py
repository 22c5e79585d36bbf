"""SmolVLA checked against LeRobot 0.4.3 live, in its own environment (`make interop-env`), both
ways: the golden fixtures are written again by LeRobot itself (tests/interop/smolvla_side.py), must
equal the committed ones, and asyncvla's SmolVLA must act on them as LeRobot did; and LeRobot must
act with a SmolVLA asyncvla exported in its format as asyncvla does. Skipped, in one line saying
how to enable it, where that environment is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from asyncvla.common.policy.smolvla import SmolVLA
from tests.support.paths import REPO
from tests.test_smolvla import frames_of

INTEROP = REPO / ".venv-interop"
LEROBOT_PYTHON = Path(os.environ.get("ASYNCVLA_LEROBOT_PYTHON", INTEROP / "bin" / "python"))
SIDE = REPO / "tests" / "interop" / "smolvla_side.py"
GOLDEN = REPO / "tests" / "golden" / "smolvla"

pytestmark = pytest.mark.skipif(
    not ((INTEROP / ".installed-smolvla").exists() or "ASYNCVLA_LEROBOT_PYTHON" in os.environ),
    reason="SmolVLA interop: lerobot[smolvla] 0.4.3's environment is absent; `make interop-env` builds it "
           "(~6 GB), or set ASYNCVLA_LEROBOT_PYTHON to a python with lerobot[smolvla]==0.4.3")


def test_lerobot_writes_the_committed_fixtures_again_and_asyncvla_acts_as_it_does(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(LEROBOT_PYTHON), str(SIDE), str(tmp_path)], capture_output=True, text=True,
                       timeout=900, env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for case in ("tiny_a", "tiny_b"):
        fresh, committed = np.load(tmp_path / case / "io.npz"), np.load(GOLDEN / case / "io.npz")
        assert sorted(fresh.keys()) == sorted(committed.keys())
        for key in fresh:
            assert np.array_equal(fresh[key], committed[key]), f"{case}: {key} differs from the committed fixture"
        for f in sorted((GOLDEN / case / "policy").iterdir()):
            assert (tmp_path / case / "policy" / f.name).read_bytes() == f.read_bytes(), f"{case}/policy/{f.name}"
    monkeypatch.chdir(tmp_path)                 # (the fixtures name their VLM "./vlm")
    for case in ("tiny_a", "tiny_b"):
        vla, z = SmolVLA.load(f"{case}/policy"), np.load(f"{case}/io.npz")
        for call in ("c1", "c2"):
            actions = vla.act_chunk(frames_of(z, call), z[f"{call}.in.observation.state"], *vla.tokenize(list(z[f"{call}.in.task"])),
                                    z[f"{call}.noise"])
            err = np.abs(actions - z[f"fp32.{call}.actions"]).max()
            print(f"{case} {call}: max |asyncvla - LeRobot| = {err:.3g} over {actions.size} action entries")
            assert err <= 1e-4


def test_lerobot_acts_with_asyncvlas_export_as_asyncvla_does(tmp_path):
    """The other way: a SmolVLA whose expert moved (as RL moves it) exported in LeRobot's format
    (`asyncvla export --format lerobot` writes it with the same export_lerobot), loaded by LeRobot's
    SmolVLAPolicy and processors, acts on the fixture inputs as asyncvla does."""
    import torch

    from asyncvla.common.config import PolicyConfig
    from asyncvla.common.policy.smolvla.kind import SmolVLAPolicy
    from tests.test_smolvla import copy_case

    case = "tiny_a"                  # (a policy kind reads one camera, as the envs give one: not tiny_b)
    source = copy_case(tmp_path / "src", case)
    policy = SmolVLAPolicy.from_lerobot(source, PolicyConfig(image_size=64, action_dim=4, state_dim=9,
                                                             num_action_chunks=4, max_instruction_tokens=16))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.net.named_parameters():
            if "lm_expert" in name or "action_" in name:
                p.add_(0.01 * torch.randn_like(p))
    out = tmp_path / case
    policy.export_lerobot(out)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(LEROBOT_PYTHON), str(SIDE), "act", str(out), str(GOLDEN / case / "io.npz"),
                        str(tmp_path / f"{case}.npz")], capture_output=True, text=True, timeout=900,
                       env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    theirs, z, vla = np.load(tmp_path / f"{case}.npz"), np.load(GOLDEN / case / "io.npz"), SmolVLA.load(out)
    for call in ("c1", "c2"):
        ours = vla.act_chunk(frames_of(z, call), z[f"{call}.in.observation.state"], *vla.tokenize(list(z[f"{call}.in.task"])),
                             z[f"{call}.noise"])
        err = np.abs(ours - theirs[f"{call}.actions"]).max()
        moved = np.abs(ours - z[f"fp32.{call}.actions"]).max()
        print(f"export {case} {call}: max |asyncvla - LeRobot| = {err:.3g} (the moved expert changed the "
              f"actions by up to {moved:.3g})")
        assert err <= 1e-4 and moved > 1e-3
