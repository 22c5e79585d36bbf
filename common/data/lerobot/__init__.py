"""Demonstrations in LeRobot's dataset format (parquet frames, mp4 videos, meta/), without lerobot:

    read.py    LeRobotSource(dir, spec, cfg.sft.lerobot): v2.1 or v3.0 -> DemoEpisode, streamed
    write.py   write_lerobot(dir, episodes, fps=..., camera=...): DemoEpisode -> v3.0
    layout.py  the file layout and metadata both share

lerobot itself is not a dependency (its releases pin torch and Python versions this project does
not); pyarrow reads and writes the parquet files, PyAV the videos.
"""

from asyncvla.common.data.lerobot.layout import is_lerobot

__all__ = ["is_lerobot"]
