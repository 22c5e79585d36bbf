"""Read a LeRobot dataset (v2.1 or v3.0, told apart by meta/info.json) as the DemoEpisodes SFT learns from.

    src = LeRobotSource(dir, spec, cfg.sft.lerobot)    # metadata read and checked: nothing decoded yet
    for episode in src.episodes(max_steps, progress):  # one episode in memory at a time
        ...

The mapping (sft.lerobot.*): the camera is a video feature (default: the first), decoded with PyAV
and resized to spec.image_size; the state is the named features concatenated (read when
spec.state_dim > 0); the action feature is the label, as recorded, and the dataset's own stats
give a new policy's action range (`action_range`); the episode's task string is its instruction.
A LeRobot episode of T frames has T observations, our episodes T+1 (the one after the last step):
the last frame is repeated, and SFT never trains on it (a sample is an observation with the
actions that follow it).
Every problem raises DemoError with one line naming the file or key, the value and what is allowed.

Actions are refused, not clipped or skipped, where they cannot be a robot's: NaN, inf, or beyond
±MAX_ABS_ACTION in any dimension (in a frame, naming its episode, frame and dimension; or in the
meta/stats.json values that become the action range). The envs take actions in [-1, 1]; a
dataset's own units (radians, degrees, millimetres, servo ticks, pixels) stay far below 1e6, so
a larger value is a corrupt one, and one such frame would widen the binned range until every
ordinary action of its dimension falls into one bin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from asyncvla.common.data.demos import DemoEpisode, DemoError, DemoSpec
from asyncvla.common.data.lerobot import layout

# The largest |action| accepted: a million times the envs' bound of 1 (see the module docstring).
MAX_ABS_ACTION = 1e6


class LeRobotSource:
    def __init__(self, root, spec: DemoSpec, mapping):
        self.root = Path(root)
        self.spec = spec
        self.info = self._read_info()
        self.version = self.info["codebase_version"]
        self.fps = self._fps()
        features = self.info["features"]
        self.camera = mapping.camera or self._first_video(features)
        self.action_key = mapping.action
        self.state_keys = list(mapping.state) if spec.state_dim else []
        self._check_features(features)
        self.tasks = self._read_tasks()
        self.records = self._read_episode_records()
        self.action_range = self._action_range(mapping.action_norm)   # {"low", "high", "source"} or None

    # ----------------------------------------------------------------------------- metadata
    def _read_info(self) -> dict:
        path = self.root / layout.INFO
        try:
            info = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DemoError(f"{path}: not readable JSON ({e})") from None
        version = info.get("codebase_version") if isinstance(info, dict) else None
        if version not in layout.VERSIONS:
            raise DemoError(f"{path}: codebase_version={version!r} is not supported; allowed: "
                            f"{', '.join(layout.VERSIONS)} (convert older datasets with lerobot's "
                            "convert_dataset_v21_to_v30 or v20_to_v21 scripts)")
        for key in ("fps", "features", "data_path", "video_path"):
            if key not in info:
                raise DemoError(f"{path}: key '{key}' is missing")
        return info

    def _fps(self) -> float:
        """info.json's fps, which times every frame in the videos: a number > 0."""
        fps = self.info["fps"]
        # (bool is an int to Python, and JSON's true is no frame rate)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
            raise DemoError(f"{self.root / layout.INFO}: key 'fps'={fps!r}; allowed: a number > 0 "
                            "(the frames per second the videos were recorded at)")
        return float(fps)

    def _first_video(self, features: dict) -> str:
        videos = [k for k, f in features.items() if f.get("dtype") == "video"]
        if not videos:
            raise DemoError(f"{self.root / layout.INFO}: no video feature (dtype 'video') to take as the camera; "
                            f"features: {', '.join(features)}")
        return videos[0]

    def _check_features(self, features: dict) -> None:
        where = self.root / layout.INFO
        named = [("sft.lerobot.camera", self.camera), ("sft.lerobot.action", self.action_key)] + \
                [("sft.lerobot.state", k) for k in self.state_keys]
        for cfg_key, feature in named:
            if feature not in features:
                raise DemoError(f"{where}: {cfg_key}={feature!r} is not a feature of this dataset; it has: "
                                f"{', '.join(features)}")
        cam = features[self.camera]
        if cam.get("dtype") != "video":
            raise DemoError(f"{where}: sft.lerobot.camera={self.camera!r} has dtype {cam.get('dtype')!r}; "
                            "allowed: a 'video' feature (images stored in the parquet files are not read)")
        if (cam.get("info") or {}).get("video.is_depth_map"):
            raise DemoError(f"{where}: sft.lerobot.camera={self.camera!r} is a depth map; allowed: an RGB video")
        shape = list(features[self.action_key].get("shape", []))
        if shape != [self.spec.action_dim]:
            raise DemoError(f"{where}: feature {self.action_key!r} (sft.lerobot.action) has shape {shape}; "
                            f"allowed: [{self.spec.action_dim}] (policy.action_dim={self.spec.action_dim})")
        if self.state_keys:
            sizes = {k: int(np.prod(features[k].get("shape", [0]))) for k in self.state_keys}
            if sum(sizes.values()) != self.spec.state_dim:
                raise DemoError(f"{where}: sft.lerobot.state={self.state_keys} holds {sum(sizes.values())} values "
                                f"per frame ({sizes}); allowed: policy.state_dim={self.spec.state_dim}")

    def _read_tasks(self) -> dict[int, str]:
        if self.version == "v2.1":
            rows = _jsonl(self.root / layout.TASKS_V21)
            return {int(r["task_index"]): str(r["task"]) for r in rows}
        table = _parquet(self.root / layout.TASKS_V3)
        # written by pandas: the task string is the index, stored as column 'task' (or unnamed)
        text = "task" if "task" in table.column_names else "__index_level_0__"
        if text not in table.column_names or "task_index" not in table.column_names:
            raise DemoError(f"{self.root / layout.TASKS_V3}: columns {table.column_names}; allowed: "
                            "task_index and the task string ('task')")
        return dict(zip(table["task_index"].to_pylist(), table[text].to_pylist()))

    def _read_episode_records(self) -> list[dict]:
        """One dict per episode, in episode order: index, length, tasks, and where its frames are."""
        if self.version == "v2.1":
            where = self.root / layout.EPISODES_V21
            records = [dict(r) for r in _jsonl(where)]
        else:
            where = self.root / layout.EPISODES_V3
            files = sorted(where.glob("chunk-*/file-*.parquet"))
            if not files:
                raise DemoError(f"{where}: no chunk-*/file-*.parquet episode metadata")
            records = []
            for f in files:
                table = _parquet(f, columns=lambda names: [n for n in names if not n.startswith("stats/")])
                records += table.to_pylist()
        records.sort(key=lambda r: r.get("episode_index", -1))
        expected = int(self.info.get("total_episodes", len(records)))
        for n, r in enumerate(records):
            if r.get("episode_index") != n:
                raise DemoError(f"{where}: episode_index={r.get('episode_index')} where {n} was due; allowed: "
                                f"0 .. {expected - 1} without gaps (total_episodes={expected}); episode {n} "
                                "is missing or the metadata is truncated")
        if len(records) != expected:
            raise DemoError(f"{where}: {len(records)} episodes; meta/info.json total_episodes={expected}")
        needed = ["length"] if self.version == "v2.1" else [
            "length", "data/chunk_index", "data/file_index"] + [
            f"videos/{self.camera}/{k}" for k in ("chunk_index", "file_index", "from_timestamp")]
        missing = [k for k in needed if records and k not in records[0]]
        if missing:
            raise DemoError(f"{where}: episode records lack {', '.join(missing)}; they have: {', '.join(records[0])}")
        return records

    def _action_range(self, mode: str) -> Optional[dict]:
        """low/high per action dimension, the range a new policy bins its actions over: q01/q99 of
        meta/stats.json where it has them, else min/max (v2.1 datasets without meta/stats.json:
        min/max over meta/episodes_stats.jsonl). A dimension the dataset holds constant gets
        [v - 1, v + 1]: a range of no width cannot be binned."""
        if mode == "none":
            return None
        stats = self._feature_stats(self.action_key)
        pair = ("q01", "q99") if "q01" in stats and "q99" in stats else ("min", "max")
        if pair[0] not in stats or pair[1] not in stats:
            raise DemoError(f"{self.root / layout.STATS}: no q01/q99 or min/max for {self.action_key!r}; "
                            "sft.lerobot.action_norm=stats needs them (or set sft.lerobot.action_norm=none)")
        low, high = (np.asarray(stats[k], np.float64).reshape(-1) for k in pair)
        if low.shape != (self.spec.action_dim,) or high.shape != low.shape:
            raise DemoError(f"{self.root / layout.STATS}: {self.action_key}.{pair[0]} has {low.size} values; "
                            f"allowed: policy.action_dim={self.spec.action_dim}")
        for key, values in zip(pair, (low, high)):
            self._check_range_end(key, values)
        flat = high - low < 1e-6
        low[flat], high[flat] = low[flat] - 1.0, high[flat] + 1.0
        return {"feature": self.action_key, "source": "/".join(pair),
                "low": [float(v) for v in low], "high": [float(v) for v in high]}

    def _check_range_end(self, key: str, values: np.ndarray) -> None:
        """The stats that become the binned range hold no value a frame could not (MAX_ABS_ACTION):
        checked here, before any decoding, as frames past sft.max_demo_steps are never read."""
        bad = np.flatnonzero(~(np.abs(values) <= MAX_ABS_ACTION))      # (NaN compares false)
        if bad.size:
            d = int(bad[0])
            where = (layout.STATS if (self.root / layout.STATS).is_file() else layout.EPISODES_STATS_V21)
            raise DemoError(f"{self.root / where}: {self.action_key}.{key}[{d}]={values[d]:g}, the "
                            f"action range's {'low' if key in ('q01', 'min') else 'high'} end in dimension "
                            f"{d}; allowed: |value| <= {MAX_ABS_ACTION:g} (a frame's action of that size is "
                            "corrupt: the envs act in [-1, 1])")

    def _feature_stats(self, key: str) -> dict:
        path = self.root / layout.STATS
        if path.is_file():
            try:
                return json.loads(path.read_text()).get(key, {})
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DemoError(f"{path}: not valid JSON ({e})") from None
        if self.version == "v2.1" and (self.root / layout.EPISODES_STATS_V21).is_file():
            per_episode = [r["stats"].get(key, {}) for r in _jsonl(self.root / layout.EPISODES_STATS_V21)]
            if all("min" in s and "max" in s for s in per_episode):
                return {"min": np.min([s["min"] for s in per_episode], axis=0),
                        "max": np.max([s["max"] for s in per_episode], axis=0)}
        return {}

    # ------------------------------------------------------------------------------ episodes
    def selected(self, max_steps: Optional[int] = None) -> list[dict]:
        """The episode records `episodes(max_steps)` yields: whole episodes in order, at most
        `max_steps` steps in all; none is refused."""
        chosen, total = [], 0
        for rec in self.records:
            if max_steps is not None and total + int(rec["length"]) > max_steps:
                break
            chosen.append(rec)
            total += int(rec["length"])
        if not chosen:
            raise DemoError(f"{self.root}: no episode to load" +
                            (f" within sft.max_demo_steps={max_steps}" if max_steps is not None else ""))
        return chosen

    def num_steps(self, max_steps: Optional[int] = None) -> int:
        """The steps `episodes(max_steps)` yields, from the metadata."""
        return sum(int(rec["length"]) for rec in self.selected(max_steps))

    def episodes(self, max_steps: Optional[int] = None, progress: bool = False) -> Iterator[DemoEpisode]:
        """The selected episodes (`selected`), one decoded at a time."""
        from tqdm import tqdm

        records, data = self.selected(max_steps), _DataFiles()
        with tqdm(total=len(records), desc=f"decoding {self.camera}", unit="episode",
                  disable=not progress, dynamic_ncols=True) as bar:
            for rec in records:
                yield self._episode(rec, data)
                bar.update(1)

    def read(self, max_steps: Optional[int] = None, progress: bool = False) -> list[DemoEpisode]:
        """Every episode in memory at once (small datasets and tests; SFT streams `episodes`)."""
        return list(self.episodes(max_steps, progress))

    def _episode(self, rec: dict, data: "_DataFiles") -> DemoEpisode:
        n, T = int(rec["episode_index"]), int(rec["length"])
        path, rows = self._rows(rec, data)
        if len(rows) != T:
            raise DemoError(f"{path}: episode {n} has {len(rows)} frames; the episodes metadata says "
                            f"length={T} (the file may be truncated)")
        actions = _column(rows, self.action_key, path).astype(np.float64)
        _check_actions(actions, self.action_key, path, n)
        images = self._frames(rec, T)
        states = None
        if self.state_keys:
            state = np.concatenate([_column(rows, k, path) for k in self.state_keys], axis=1)
            states = {"agent/state": np.concatenate([state, state[-1:]]).astype(np.float32)}
        rewards = _column(rows, layout.REWARD, path)[:, 0] if layout.REWARD in rows.column_names else None
        success = (_column(rows, layout.SUCCESS, path)[:, 0].astype(bool) if layout.SUCCESS in rows.column_names
                   else np.zeros(T, bool))
        task_index = int(rows["task_index"][0].as_py()) if "task_index" in rows.column_names else None
        instruction = self.tasks.get(task_index) or next(iter(rec.get("tasks") or []), None)
        return DemoEpisode(images=np.concatenate([images, images[-1:]]), actions=actions.astype(np.float32),
                           rewards=None if rewards is None else rewards.astype(np.float32), success=success,
                           instruction=instruction, seed=None, episode_id=n, states=states)

    def _rows(self, rec: dict, data: "_DataFiles"):
        """(file, the episode's rows) of the data parquet."""
        n = int(rec["episode_index"])
        if self.version == "v2.1":
            chunk = n // int(self.info.get("chunks_size", layout.CHUNKS_SIZE))
            path = self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=n)
            return path, _parquet(path)
        path = self.root / self.info["data_path"].format(chunk_index=int(rec["data/chunk_index"]),
                                                         file_index=int(rec["data/file_index"]))
        return path, data.episode(path, n)

    def _frames(self, rec: dict, T: int) -> np.ndarray:
        n = int(rec["episode_index"])
        if self.version == "v2.1":
            chunk = n // int(self.info.get("chunks_size", layout.CHUNKS_SIZE))
            path = self.root / self.info["video_path"].format(episode_chunk=chunk, episode_index=n,
                                                              video_key=self.camera)
            start = 0.0
        else:
            k = f"videos/{self.camera}/"
            path = self.root / self.info["video_path"].format(video_key=self.camera,
                                                              chunk_index=int(rec[k + "chunk_index"]),
                                                              file_index=int(rec[k + "file_index"]))
            start = float(rec[k + "from_timestamp"])
        return decode_frames(path, start, T, self.fps, self.spec.image_size, n)


class _DataFiles:
    """The v3.0 data file now being read (episodes are contiguous in files, in order): one file in memory."""

    def __init__(self):
        self.path, self.table, self.episode_index = None, None, None

    def episode(self, path: Path, n: int):
        import pyarrow.compute as pc

        if path != self.path:
            self.path, self.table = path, _parquet(path)
            if "episode_index" not in self.table.column_names:
                raise DemoError(f"{path}: column 'episode_index' is missing")
            self.episode_index = self.table["episode_index"]
        return self.table.filter(pc.equal(self.episode_index, n))


def _check_actions(actions: np.ndarray, key: str, path: Path, episode: int) -> None:
    """Refuse the first frame whose action is NaN, inf or beyond ±MAX_ABS_ACTION (module docstring)."""
    bad = np.argwhere(~(np.abs(actions) <= MAX_ABS_ACTION))         # (NaN compares false)
    if len(bad):
        frame, d = (int(i) for i in bad[0])
        raise DemoError(f"{path}: episode {episode}, frame {frame}: {key}[{d}]={actions[frame, d]:g}; allowed: "
                        f"finite, |value| <= {MAX_ABS_ACTION:g} (the envs act in [-1, 1]; a dataset's "
                        "units stay far below this, so the value is corrupt)")


def decode_frames(path: Path, start_s: float, count: int, fps: float, size: int, episode: int) -> np.ndarray:
    """uint8 [count, size, size, 3]: the `count` frames from time `start_s` of the video at `path`,
    each resized to size x size (area-averaged, as frames are usually larger than the policy's)."""
    import av

    half = 0.5 / fps
    frames = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            if start_s > 0:    # to the key frame at or before it, then decode forward
                container.seek(int(start_s / stream.time_base), stream=stream, backward=True)
            for i, frame in enumerate(container.decode(stream)):
                t = frame.time if frame.time is not None else i / fps
                if t < start_s - half:
                    continue
                frames.append(frame.to_ndarray(width=size, height=size, format="rgb24", interpolation="AREA"))
                if len(frames) == count:
                    break
    except (av.FFmpegError, IndexError, OSError) as e:
        raise DemoError(f"{path}: episode {episode}: the video does not decode ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no video stream'}); allowed: an mp4 "
                        "PyAV decodes") from None
    if len(frames) != count:
        raise DemoError(f"{path}: episode {episode}: {len(frames)} frames from t={start_s:.3f} s; expected "
                        f"{count} (the episode's length at {fps:g} fps): the video is truncated or short")
    return np.stack(frames)


# ------------------------------------------------------------------------------------ helpers
def _parquet(path: Path, columns=None):
    """The parquet table at `path` (`columns`: a function of the file's column names -> those to read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        return f.read(columns=columns(names) if columns else None)
    except FileNotFoundError:
        raise DemoError(f"{path}: missing") from None
    except (pa.ArrowException, OSError) as e:
        raise DemoError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]}); it may be "
                        "truncated") from None


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise DemoError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DemoError(f"{path}: not valid JSON lines ({e}); it may be truncated") from None


def _column(rows, key: str, path: Path) -> np.ndarray:
    """float64 [n, d] of a scalar or fixed-length list column."""
    import pyarrow as pa

    if key not in rows.column_names:
        raise DemoError(f"{path}: column {key!r} is missing; it has: {', '.join(rows.column_names)}")
    col = rows[key].combine_chunks()
    nested = pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type)
    values = (col.flatten() if nested else col).to_numpy(zero_copy_only=False).astype(np.float64)
    if len(col) and values.size % len(col):
        raise DemoError(f"{path}: column {key!r} holds lists of different lengths; allowed: one length")
    return values.reshape(len(col), -1)
