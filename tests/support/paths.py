"""Where the repository and the configs tests run are:

    REPO        the repository's root (a Path)
    PIXEL       configs/pixel_task.yaml, the small pixel task most runs and configs start from
    MANISKILL   configs/maniskill.yaml, the ManiSkill pipeline's config
    QUICKSTART  configs/quickstart.yaml, the quick start's ManiSkill config
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIXEL = REPO / "configs" / "pixel_task.yaml"
MANISKILL = REPO / "configs" / "maniskill.yaml"
QUICKSTART = REPO / "configs" / "quickstart.yaml"
