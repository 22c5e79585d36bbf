"""LeRobot's dataset layout, as lerobot's own datasets/utils.py and video_utils.py define it.

v3.0 (what write.py writes; episodes concatenated into files):
    meta/info.json                              codebase_version, fps, features, path templates
    meta/stats.json                             {feature: {min, max, mean, std, count, q01, ..., q99}}
    meta/tasks.parquet                          task_index, with the task string as the (pandas) index
    meta/episodes/chunk-000/file-000.parquet    one row per episode: episode_index, tasks, length,
                                                data/{chunk,file}_index, dataset_{from,to}_index,
                                                videos/<key>/{chunk_index,file_index,from_timestamp,to_timestamp}
    data/chunk-000/file-000.parquet             one row per frame: the features, timestamp, frame_index,
                                                episode_index, index, task_index
    videos/<key>/chunk-000/file-000.mp4
v2.1 (read only; one file per episode):
    meta/info.json, meta/episodes.jsonl, meta/tasks.jsonl, meta/episodes_stats.jsonl
    data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet
    videos/chunk-{episode_chunk:03d}/<key>/episode_{episode_index:06d}.mp4

A frame is one step: the observation at t and the action taken at t.
"""

from __future__ import annotations

from pathlib import Path

INFO = "meta/info.json"
STATS = "meta/stats.json"
TASKS_V3 = "meta/tasks.parquet"
EPISODES_V3 = "meta/episodes"
EPISODES_V21 = "meta/episodes.jsonl"
TASKS_V21 = "meta/tasks.jsonl"
EPISODES_STATS_V21 = "meta/episodes_stats.jsonl"
VERSIONS = ("v2.1", "v3.0")

CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
EPISODES_PATH = EPISODES_V3 + "/" + CHUNK_FILE + ".parquet"
CHUNKS_SIZE = 1000                 # files per chunk directory (lerobot's DEFAULT_CHUNK_SIZE)
DATA_FILES_SIZE_MB = 100           # lerobot's defaults, recorded in info.json
VIDEO_FILES_SIZE_MB = 200

# Every frame's bookkeeping columns (lerobot's DEFAULT_FEATURES).
BOOKKEEPING = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
# Optional per-frame reward and success, as lerobot's simulation datasets (pusht, xarm) name them.
REWARD, SUCCESS, DONE = "next.reward", "next.success", "next.done"
QUANTILES = ("q01", "q10", "q50", "q90", "q99")


def is_lerobot(path) -> bool:
    """A directory holding meta/info.json: a LeRobot dataset (else ManiSkill's trajectory files)."""
    return path is not None and (Path(path) / INFO).is_file()


def lacks_info(path) -> bool:
    """A directory laid out as a LeRobot dataset (meta/ and data/) but without meta/info.json: a
    LeRobot dataset whose info.json was lost, or whose writing stopped early (lerobot's writer and
    ours write it last), rather than a directory of ManiSkill's trajectory files."""
    p = Path(path)
    return (p / "meta").is_dir() and (p / "data").is_dir() and not (p / INFO).is_file()
