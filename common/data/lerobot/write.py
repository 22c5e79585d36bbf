"""Write demonstrations as a LeRobot v3.0 dataset (layout.py), streamed episode by episode.

    write_lerobot(out_dir, episodes, fps=20, camera="base_camera", default_task="push the cube ...")

Features: observation.images.<camera> (H.264 in mp4, yuv420p, through PyAV: what lerobot's
decoders and most players read), observation.state (where the episodes carry a state: their
obs/agent then obs/extra leaves, as `flat_states` orders them), action (the labels: the
demonstrator's action where a noisy one was executed), next.reward / next.done / next.success,
and lerobot's bookkeeping columns. A frame is an observation and the action taken there, so an
episode of T steps is T frames: the observation after the last step is not written.
All episodes go to file-000 of chunk-000 (data, video and episode metadata alike).
"""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from asyncvla.common.data.demos import STATE_GROUPS, DemoEpisode, flat_states
from asyncvla.common.data.lerobot import layout

VIDEO_CODEC = "h264"           # libx264 through PyAV; lerobot's own default is AV1 (libsvtav1)
VIDEO_OPTIONS = {"crf": "18", "g": "2"}   # near-lossless; a key frame every 2 frames, as lerobot, for seeking
DTYPES = {"float": "float32", "bool": "bool", "int64": "int64"}    # arrow's names -> lerobot's (numpy's)


def write_lerobot(out_dir, episodes: Iterable[DemoEpisode], fps: int, camera: str,
                  default_task: Optional[str] = None, robot_type: Optional[str] = None,
                  progress: bool = False) -> Path:
    """Write `episodes` under out_dir (its meta/, data/ and videos/ replaced; other files kept).
    meta/info.json is written last: until then the directory is not a dataset to a reader."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("meta", "data", "videos"):
        shutil.rmtree(out / sub, ignore_errors=True)
    image_key = f"observation.images.{camera}"
    where = {"chunk_index": 0, "file_index": 0}
    data_path, episodes_path = layout.DATA_PATH.format(**where), layout.EPISODES_PATH.format(**where)
    video_path = layout.VIDEO_PATH.format(video_key=image_key, **where)
    tasks: dict[str, int] = {}
    records, columns, frames_stats = [], {}, _ImageStats()
    data, video, schema, state_names = None, None, None, None
    total = 0
    try:
        for n, ep in enumerate(tqdm(episodes, desc="writing", unit="episode", disable=not progress)):
            T = ep.num_steps
            text = ep.instruction or default_task
            if not text:
                raise ValueError(f"episode {ep.episode_id} has no instruction; give a task text (--task or env.instruction)")
            task_index = tasks.setdefault(text, len(tasks))
            if data is None:
                state_names = _state_names(ep.states) if ep.states else None
                schema = _schema(ep.actions.shape[1], len(state_names) if state_names else 0)
                data = _parquet_writer(out / data_path, schema)
                video = _Video(out / video_path, fps, ep.images.shape[1], ep.images.shape[2])
            elif bool(ep.states) != (state_names is not None):
                raise ValueError(f"episode {ep.episode_id}: some episodes carry a state and others do not")
            row = _frame_columns(ep, n, total, task_index, fps)
            data.write_table(_table(row, schema))
            for key, value in row.items():
                columns.setdefault(key, []).append(value)
            start = video.frames / fps
            for image in ep.images[:T]:
                video.add(image)
                frames_stats.add(image)
            records.append({"episode_index": n, "tasks": [text], "length": T,
                            "data/chunk_index": 0, "data/file_index": 0,
                            "dataset_from_index": total, "dataset_to_index": total + T,
                            f"videos/{image_key}/chunk_index": 0, f"videos/{image_key}/file_index": 0,
                            f"videos/{image_key}/from_timestamp": start,
                            f"videos/{image_key}/to_timestamp": video.frames / fps,
                            "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
            total += T
    finally:
        if data is not None:
            data.close()
            video.close()
    if not records:
        raise ValueError("no episodes to write")

    _write_episodes(out / episodes_path, records)
    _write_tasks(out / layout.TASKS_V3, tasks)
    stats = {key: _vector_stats(np.concatenate(v)) for key, v in columns.items()}
    stats[image_key] = frames_stats.result()
    (out / layout.STATS).write_text(json.dumps(stats, indent=2))
    features = _features(image_key, video, fps, schema, state_names)
    info = {"codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": len(records),
            "total_frames": total, "total_tasks": len(tasks), "chunks_size": layout.CHUNKS_SIZE,
            "data_files_size_in_mb": layout.DATA_FILES_SIZE_MB,
            "video_files_size_in_mb": layout.VIDEO_FILES_SIZE_MB, "fps": int(fps),
            "splits": {"train": f"0:{len(records)}"}, "data_path": layout.DATA_PATH,
            "video_path": layout.VIDEO_PATH, "features": features}
    (out / layout.INFO).write_text(json.dumps(info, indent=4))
    return out


# ------------------------------------------------------------------------------------- frames
def _frame_columns(ep: DemoEpisode, n: int, first_index: int, task_index: int, fps: int) -> dict:
    """numpy columns of one episode's T frames."""
    T = ep.num_steps
    ended = np.arange(T) == T - 1
    row = {"action": ep.actions.astype(np.float32)}
    if ep.states:
        row["observation.state"] = flat_states(ep.states)[:T]
    row.update({
        layout.REWARD: (ep.rewards if ep.rewards is not None else np.zeros(T)).astype(np.float32),
        layout.DONE: ended, layout.SUCCESS: ep.success.astype(bool),
        "timestamp": (np.arange(T) / fps).astype(np.float32), "frame_index": np.arange(T, dtype=np.int64),
        "episode_index": np.full(T, n, np.int64), "index": first_index + np.arange(T, dtype=np.int64),
        "task_index": np.full(T, task_index, np.int64)})
    return row


def _schema(action_dim: int, state_dim: int):
    """Fixed-length float32 lists for vectors, scalars for shape [1] (as lerobot's HF features map them)."""
    import pyarrow as pa

    fields = [("action", pa.list_(pa.float32(), action_dim))]
    if state_dim:
        fields.append(("observation.state", pa.list_(pa.float32(), state_dim)))
    fields += [(layout.REWARD, pa.float32()), (layout.DONE, pa.bool_()), (layout.SUCCESS, pa.bool_()),
               ("timestamp", pa.float32())] + [(k, pa.int64()) for k in ("frame_index", "episode_index",
                                                                        "index", "task_index")]
    return pa.schema(fields)


def _table(row: dict, schema):
    import pyarrow as pa

    arrays = []
    for field in schema:
        value = row[field.name]
        if pa.types.is_fixed_size_list(field.type):
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(value.reshape(-1)), field.type.list_size))
        else:
            arrays.append(pa.array(value, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _parquet_writer(path: Path, schema):
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    return pq.ParquetWriter(path, schema)


def _state_names(states: dict) -> list[str]:
    """Names of the flat state's values, in `flat_states` order: agent/qpos/0, agent/qpos/1, ..."""
    keys = sorted(states, key=lambda k: (STATE_GROUPS.index(k.split("/")[0]), k))
    return [f"{k}/{i}" for k in keys for i in range(int(np.prod(states[k].shape[1:])))]


class _Video:
    """One mp4 the episodes' frames are appended to, frame i at time i / fps."""

    def __init__(self, path: Path, fps: int, height: int, width: int):
        import av

        if height % 2 or width % 2:
            raise ValueError(f"images of {height} x {width}: yuv420p video needs an even height and width")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fps, self.height, self.width, self.frames = fps, height, width, 0
        self.container = av.open(str(path), "w")
        self.stream = self.container.add_stream("libx264", rate=fps, options=dict(VIDEO_OPTIONS))
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"

    def add(self, image: np.ndarray) -> None:
        import av

        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
        frame.pts, frame.time_base = self.frames, Fraction(1, self.fps)
        self.container.mux(self.stream.encode(frame))
        self.frames += 1

    def close(self) -> None:
        self.container.mux(self.stream.encode())      # flush the encoder's delayed frames
        self.container.close()


# --------------------------------------------------------------------------------------- meta
def _features(image_key: str, video: _Video, fps: int, schema, state_names) -> dict:
    import pyarrow as pa

    features = {image_key: {"dtype": "video", "shape": [video.height, video.width, 3],
                            "names": ["height", "width", "channels"],
                            "info": {"video.height": video.height, "video.width": video.width,
                                     "video.codec": VIDEO_CODEC, "video.pix_fmt": "yuv420p",
                                     "video.is_depth_map": False, "video.fps": int(fps),
                                     "video.channels": 3, "has_audio": False}}}
    for field in schema:
        if field.name in layout.BOOKKEEPING:
            continue
        vector = pa.types.is_fixed_size_list(field.type)
        dtype = DTYPES[str(field.type.value_type if vector else field.type)]
        size = field.type.list_size if vector else 1
        names = (state_names if field.name == "observation.state" else
                 [f"{field.name}_{i}" for i in range(size)] if vector else None)
        features[field.name] = {"dtype": dtype, "shape": [size], "names": names}
    features.update(layout.BOOKKEEPING)
    return features


def _write_episodes(path: Path, records: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def _write_tasks(path: Path, tasks: dict[str, int]) -> None:
    """tasks.parquet as pandas writes a frame indexed by the task string (lerobot reads it with
    pandas: the 'pandas' schema metadata makes 'task' the index again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"task_index": pa.array(list(tasks.values()), pa.int64()),
                      "task": pa.array(list(tasks), pa.string())})
    pandas_meta = {"index_columns": ["task"], "column_indexes": [], "pandas_version": "2.2.3",
                   "creator": {"library": "pyarrow", "version": pa.__version__},
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": "task", "field_name": "task", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}]}
    table = table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _vector_stats(values: np.ndarray) -> dict:
    """lerobot's per-feature stats of a column [n] or [n, d]: mean, std, min, max, count, quantiles."""
    v = values.reshape(len(values), -1).astype(np.float64)
    out = {"min": v.min(0), "max": v.max(0), "mean": v.mean(0), "std": v.std(0), "count": np.array([len(v)])}
    out.update({q: np.quantile(v, int(q[1:]) / 100, axis=0) for q in layout.QUANTILES})
    return {k: x.tolist() for k, x in out.items()}


class _ImageStats:
    """Per channel over every frame, in [0, 1] and shaped [3, 1, 1] as lerobot keeps image stats."""

    def __init__(self):
        self.frames, self.n, self.sum, self.sumsq = 0, 0, np.zeros(3), np.zeros(3)
        self.min, self.max = np.full(3, np.inf), np.full(3, -np.inf)

    def add(self, image: np.ndarray) -> None:
        x = image.reshape(-1, 3).astype(np.float64) / 255.0
        self.frames, self.n = self.frames + 1, self.n + len(x)
        self.sum += x.sum(0)
        self.sumsq += (x * x).sum(0)
        self.min, self.max = np.minimum(self.min, x.min(0)), np.maximum(self.max, x.max(0))

    def result(self) -> dict:
        mean = self.sum / self.n
        std = np.sqrt(np.maximum(self.sumsq / self.n - mean * mean, 0.0))
        shape = lambda a: a.reshape(3, 1, 1).tolist()     # noqa: E731
        return {"min": shape(self.min), "max": shape(self.max), "mean": shape(mean), "std": shape(std),
                "count": [self.frames]}
