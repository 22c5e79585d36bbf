"""The wheel holds the whole package, and runs once installed without the checkout.

`make setup` installs the checkout in editable mode, where every folder is importable whatever the
packaging says; a wheel holds only what setup.py / setup.cfg name. A package missing from a hand-kept
list (asyncvla.common.data.lerobot once was) broke `pip install .` while every other test passed. So:
build the wheel from a copy of the checkout, as a fresh clone would have it (the source tree gets no
build/ folder), compare its members with git's file list, install it into a new venv that is not
editable, and run it from there. ~10 s on 2 quiet cores (~20 with one busy), most of it importing
torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the folders that install as asyncvla.<folder> (setup.py)
FOLDERS = ("actors", "common", "learner", "launch")
# pip finds nothing on the network: the build uses this venv's setuptools, the install no index
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def checkout_files() -> list[str]:
    """What a clone of this tree would hold: the tracked files, and the new ones git does not ignore
    (a module not yet committed must ship too)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no git file list to build from ({e})")
    # (a tracked file deleted in the work tree is listed still, and would not be in the clone)
    return [p for p in out.decode().split("\0") if p and (REPO / p).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[str]]:
    """(the wheel, the checkout's files) -- built once for both tests."""
    tmp = tmp_path_factory.mktemp("packaging")
    files = checkout_files()
    src = tmp / "src"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    out = tmp / "dist"
    # absolute paths: a bare name such as `src` would be looked up as a project on the index
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **PIP_ENV})
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("asyncvla-*.whl"))
    assert len(wheels) == 1, f"expected one asyncvla wheel in {out}: {wheels}"
    return wheels[0], files


def test_wheel_holds_every_module_and_data_file(built):
    wheel, files = built
    expected = {f"asyncvla/{p}" for p in files if p.split("/", 1)[0] in FOLDERS}
    assert "asyncvla/launch/slurm/asyncvla.sbatch" in expected, "the file list lacks the sbatch file"
    with zipfile.ZipFile(wheel) as z:
        members = set(z.namelist())
    missing = sorted(expected - members)
    assert not missing, (f"{wheel.name} lacks {len(missing)} of the source tree's files (setup.py finds "
                         f"the packages, setup.cfg's package_data ships the other files): {missing}")


# Run in the new venv: where the modules come from, what the package holds, which finders are on.
PROBE = """
import json, sys
from pathlib import Path
import asyncvla.learner.sft, asyncvla.common.data.lerobot.read, asyncvla.launch
launch = Path(asyncvla.launch.__file__).parent
print(json.dumps({
    "modules": [asyncvla.learner.sft.__file__, asyncvla.common.data.lerobot.read.__file__],
    "data": [str(p) for p in (launch / "slurm" / "asyncvla.sbatch", launch / "setup_vulkan.sh")
             if p.is_file()],
    "editable_finders": [str(f) for f in sys.meta_path
                         if getattr(f, "__module__", "").startswith("__editable__")],
}))
"""


def test_installed_wheel_runs(built, tmp_path):
    wheel, _ = built
    venv = tmp_path / "venv"
    # no pip of its own: this venv's pip installs into it (--python), so the venv takes ~0.1 s
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                        "--no-index", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **PIP_ENV})
    assert r.returncode == 0, f"pip install of {wheel.name} failed:\n{r.stdout}\n{r.stderr}"

    # The dependencies (torch, ...) come from this venv, named in a .pth file -- written after the
    # install, so pip saw no asyncvla there already. Python reads .pth files in site directories
    # only, not in a folder that a .pth line adds: this venv's editable install (its
    # __editable__*.pth finder) stays off, and asyncvla can come from the wheel alone (PROBE checks).
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (Path(site) / "asyncvla_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))

    # outside the checkout, without PYTHONPATH or user site-packages: nothing but the venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    r = subprocess.run([str(venv / "bin" / "asyncvla"), "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"the installed `asyncvla --help` failed:\n{r.stdout}\n{r.stderr}"
    assert "pipeline" in r.stdout, r.stdout

    r = subprocess.run([str(python), "-c", PROBE], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"importing the installed package failed:\n{r.stderr}"
    probe = json.loads(r.stdout.strip().splitlines()[-1])
    assert probe["editable_finders"] == [], f"the checkout's editable finder is on: {probe}"
    for module in probe["modules"]:
        assert Path(module).is_relative_to(venv), f"{module} is not the wheel's (in {venv})"
    assert len(probe["data"]) == 2, f"the installed package lacks its data files: {probe}"
