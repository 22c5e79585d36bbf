"""Demonstrations in LeRobot's format: our v3.0 writer read back by our reader (actions and states
exact, frames within H.264's tolerance), a v2.1 dataset written here by hand with pyarrow and PyAV,
the action normalisation from the dataset's stats, one-line errors for bad datasets, `asyncvla
collect --format lerobot` and `asyncvla convert`, and `asyncvla sft` on a written dataset."""

import json
import subprocess
import sys

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncvla.actors.collect import collect_demos, env_info
from asyncvla.common.config import LeRobotConfig, load_config
from asyncvla.common.data.demos import DemoEpisode, DemoError, DemoSpec, flat_states, read_demos, write_demos
from asyncvla.common.data.lerobot.read import LeRobotSource
from asyncvla.common.data.lerobot.write import write_lerobot
from asyncvla.common.policy import VLAPolicy
from asyncvla.launch import cli
from asyncvla.learner.sft import load_samples
from asyncvla.learner.sft_data import build_samples, split_by_episode
from tests.support.paths import PIXEL

SPEC = DemoSpec(image_size=64, action_dim=2, state_dim=5)
EXACT = LeRobotConfig(action_norm="none")
MAX_PIXEL_ERROR = 4.0         # mean abs error per pixel value (0..255) that H.264 at crf 18 may add


def made_up_episodes(lengths=(5, 7, 4), seed=0) -> list[DemoEpisode]:
    """Smooth images that differ per episode (blue) and per step (a moving red ramp), so that a frame
    taken from the wrong episode or step is far off."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:64, 0:64]
    episodes = []
    for i, T in enumerate(lengths):
        images = np.stack([np.stack([(xx * 2 + 12 * t) % 256, yy * 3, np.full_like(xx, 60 * i)], -1)
                           for t in range(T + 1)]).astype(np.uint8)
        episodes.append(DemoEpisode(
            images=images, actions=rng.uniform(-1, 1, (T, 2)).astype(np.float32),
            rewards=rng.random(T).astype(np.float32), success=np.arange(T) == T - 1,
            instruction=f"reach target {i % 2}", seed=i, episode_id=i,
            states={"agent/qpos": rng.random((T + 1, 3)).astype(np.float32),
                    "extra/goal": rng.random((T + 1, 2)).astype(np.float32)}))
    return episodes


def pixel_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    episodes = made_up_episodes()
    out = tmp_path_factory.mktemp("lerobot") / "ds"
    write_lerobot(out, episodes, fps=10, camera="base_camera")
    return out, episodes


def copy_of(written, tmp_path):
    import shutil
    return shutil.copytree(written[0], tmp_path / "ds")


# ------------------------------------------------------------------------------- round trip
def test_written_dataset_reads_back(written):
    out, episodes = written
    source = LeRobotSource(out, SPEC, EXACT)
    assert source.version == "v3.0" and source.camera == "observation.images.base_camera"
    read = source.read()
    assert [e.num_steps for e in read] == [e.num_steps for e in episodes]
    for ours, back in zip(episodes, read):
        T = ours.num_steps
        np.testing.assert_array_equal(back.actions, ours.actions)
        np.testing.assert_array_equal(back.states["agent/state"][:T], flat_states(ours.states)[:T])
        np.testing.assert_array_equal(back.rewards, ours.rewards)
        np.testing.assert_array_equal(back.success, ours.success)
        assert back.instruction == ours.instruction
        assert back.images.shape == ours.images.shape           # T + 1: the last frame repeated
        err = pixel_error(back.images[:T], ours.images[:T])
        assert err < MAX_PIXEL_ERROR, f"episode {ours.episode_id}: mean abs pixel error {err:.2f}"
        np.testing.assert_array_equal(back.images[T], back.images[T - 1])


def test_written_metadata_is_lerobots(written):
    out, episodes = written
    info = json.loads((out / "meta/info.json").read_text())
    frames = sum(e.num_steps for e in episodes)
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, frames, 2)
    assert info["features"]["observation.state"]["names"][:2] == ["agent/qpos/0", "agent/qpos/1"]
    assert info["features"]["action"] == {"dtype": "float32", "shape": [2], "names": ["action_0", "action_1"]}
    stats = json.loads((out / "meta/stats.json").read_text())
    actions = np.concatenate([e.actions for e in episodes])
    np.testing.assert_allclose(stats["action"]["q99"], np.quantile(actions, 0.99, axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["action"]["mean"], actions.mean(0), rtol=1e-5)
    assert np.array(stats["observation.images.base_camera"]["mean"]).shape == (3, 1, 1)
    tasks = pq.read_table(out / "meta/tasks.parquet")
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    assert tasks.to_pydict() == {"task_index": [0, 1], "task": ["reach target 0", "reach target 1"]}
    eps = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["dataset_from_index"] for e in eps] == [0, 5, 12]
    assert eps[2]["videos/observation.images.base_camera/from_timestamp"] == pytest.approx(1.2)
    data = pq.read_table(out / "data/chunk-000/file-000.parquet")
    assert data["index"].to_pylist() == list(range(frames))
    action = data.schema.field("action").type          # lerobot's Sequence(float32, length=2)
    assert pa.types.is_fixed_size_list(action) and (action.list_size, action.value_type) == (2, pa.float32())
    with av.open(str(out / "videos/observation.images.base_camera/chunk-000/file-000.mp4")) as c:
        stream = c.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert sum(1 for _ in c.decode(stream)) == frames


def test_episodes_stream_one_at_a_time_and_stop_at_max_steps(written):
    source = LeRobotSource(written[0], SPEC, EXACT)
    stream = source.episodes(max_steps=12)
    assert next(stream).num_steps == 5                 # a generator: nothing decoded ahead
    assert [e.num_steps for e in stream] == [7]        # 5 + 7 = 12; the next episode (4) would pass it


def test_images_resize_to_the_policy(written):
    small = LeRobotSource(written[0], DemoSpec(image_size=32, action_dim=2), EXACT).read()
    assert small[0].images.shape == (6, 32, 32, 3) and small[0].states is None


def test_the_datasets_stats_give_the_action_range(written, tmp_path):
    """The labels stay in the dataset's units; its q01/q99 (else min/max) become a new policy's
    binned range, so the policy acts in those units with nothing to map back."""
    out = copy_of(written, tmp_path)
    stats = json.loads((out / "meta/stats.json").read_text())
    raw = np.concatenate([e.actions for e in written[1]]).astype(np.float64)

    source = LeRobotSource(out, SPEC, LeRobotConfig())
    assert source.action_range["source"] == "q01/q99"
    np.testing.assert_allclose(source.action_range["low"], stats["action"]["q01"])
    np.testing.assert_allclose(source.action_range["high"], stats["action"]["q99"])
    np.testing.assert_array_equal(np.concatenate([e.actions for e in source.read()]), raw.astype(np.float32))
    assert LeRobotSource(out, SPEC, EXACT).action_range is None

    for q in ("q01", "q10", "q50", "q90", "q99"):       # a dataset whose stats hold no quantiles
        del stats["action"][q]
    stats["action"]["min"][1] = stats["action"]["max"][1] = 0.25   # and one dimension held constant
    (out / "meta/stats.json").write_text(json.dumps(stats))
    source = LeRobotSource(out, SPEC, LeRobotConfig())
    assert source.action_range["source"] == "min/max"
    got = np.array([source.action_range["low"], source.action_range["high"]])
    np.testing.assert_allclose(got, [[raw[:, 0].min(), -0.75], [raw[:, 0].max(), 1.25]], rtol=1e-6)


# ------------------------------------------------------------------------------------ v2.1
def write_v21(root, episodes, fps=10, key="observation.images.front"):
    """A LeRobot v2.1 dataset as lerobot 0.3 writes one: a parquet and an mp4 per episode."""
    info = {"codebase_version": "v2.1", "robot_type": "made_up", "total_episodes": len(episodes),
            "total_frames": sum(e.num_steps for e in episodes), "total_tasks": 1, "total_videos": len(episodes),
            "total_chunks": 1, "chunks_size": 1000, "fps": fps, "splits": {"train": f"0:{len(episodes)}"},
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": {key: {"dtype": "video", "shape": [64, 64, 3], "names": ["height", "width", "channel"]},
                         "observation.state": {"dtype": "float32", "shape": [5], "names": None},
                         "action": {"dtype": "float32", "shape": [2], "names": None},
                         "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                         "frame_index": {"dtype": "int64", "shape": [1], "names": None},
                         "episode_index": {"dtype": "int64", "shape": [1], "names": None},
                         "index": {"dtype": "int64", "shape": [1], "names": None},
                         "task_index": {"dtype": "int64", "shape": [1], "names": None}}}
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "stack the blocks"}) + "\n")
    lines, stat_lines, index = [], [], 0
    for n, ep in enumerate(episodes):
        T = ep.num_steps
        lines.append(json.dumps({"episode_index": n, "tasks": ["stack the blocks"], "length": T}))
        stat_lines.append(json.dumps({"episode_index": n, "stats": {"action": {
            "min": ep.actions.min(0).tolist(), "max": ep.actions.max(0).tolist()}}}))
        table = pa.table({"observation.state": list(flat_states(ep.states)[:T]), "action": list(ep.actions),
                          "timestamp": pa.array(np.arange(T) / fps, pa.float32()), "frame_index": np.arange(T),
                          "episode_index": np.full(T, n), "index": index + np.arange(T), "task_index": np.zeros(T, int)})
        data = root / f"data/chunk-000/episode_{n:06d}.parquet"
        data.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, data)                    # plain (variable-length) lists, as HF datasets wrote them
        index += T
        video = root / f"videos/chunk-000/{key}/episode_{n:06d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(video), "w") as c:
            s = c.add_stream("libx264", rate=fps)
            s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
            for image in ep.images[:T]:
                c.mux(s.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
            c.mux(s.encode())
    (root / "meta/episodes.jsonl").write_text("\n".join(lines) + "\n")
    (root / "meta/episodes_stats.jsonl").write_text("\n".join(stat_lines) + "\n")
    return root


def test_v21_dataset_reads(tmp_path):
    episodes = made_up_episodes((6, 3), seed=1)
    source = LeRobotSource(write_v21(tmp_path / "v21", episodes), SPEC, EXACT)
    assert source.version == "v2.1" and source.camera == "observation.images.front"
    read = source.read()
    for ours, back in zip(episodes, read):
        T = ours.num_steps
        np.testing.assert_array_equal(back.actions, ours.actions)
        np.testing.assert_array_equal(back.states["agent/state"][:T], flat_states(ours.states)[:T])
        assert back.instruction == "stack the blocks" and back.rewards is None
        err = pixel_error(back.images[:T], ours.images[:T])
        assert err < MAX_PIXEL_ERROR, f"episode {ours.episode_id}: mean abs pixel error {err:.2f}"
    norm = LeRobotSource(tmp_path / "v21", SPEC, LeRobotConfig()).action_range   # episodes_stats.jsonl
    all_actions = np.concatenate([e.actions for e in episodes])
    assert norm["source"] == "min/max"
    np.testing.assert_allclose(norm["low"], all_actions.min(0), rtol=1e-6)


# ------------------------------------------------------------------------------- bad input
def one_line_error(root, spec=SPEC, mapping=EXACT) -> str:
    with pytest.raises(DemoError) as e:
        LeRobotSource(root, spec, mapping).read()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_unknown_codebase_version(written, tmp_path):
    out = copy_of(written, tmp_path)
    info = json.loads((out / "meta/info.json").read_text())
    (out / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    msg = one_line_error(out)
    assert "codebase_version='v1.6'" in msg and "v2.1, v3.0" in msg


def test_missing_feature_lists_what_the_dataset_has(written):
    msg = one_line_error(written[0], mapping=LeRobotConfig(camera="observation.images.wrist"))
    assert "sft.lerobot.camera='observation.images.wrist'" in msg
    assert "observation.images.base_camera, action, observation.state" in msg
    msg = one_line_error(written[0], mapping=LeRobotConfig(state=["observation.joints"]))
    assert "sft.lerobot.state='observation.joints'" in msg


def test_action_dimension_must_match_the_policy(written):
    msg = one_line_error(written[0], spec=DemoSpec(image_size=64, action_dim=7))
    assert "'action'" in msg and "shape [2]" in msg and "policy.action_dim=7" in msg


def test_video_that_does_not_decode(written, tmp_path):
    out = copy_of(written, tmp_path)
    video = out / "videos/observation.images.base_camera/chunk-000/file-000.mp4"
    video.write_bytes(b"\x00not an mp4" * 100)
    msg = one_line_error(out)
    assert str(video) in msg and "does not decode" in msg and "episode 0" in msg


def test_short_video(written, tmp_path):
    out = copy_of(written, tmp_path)
    meta = out / "meta/episodes/chunk-000/file-000.parquet"
    rows = pq.read_table(meta).to_pylist()
    rows[2]["length"] = 6                      # the video holds 4 frames of episode 2
    rows[2]["dataset_to_index"] += 2
    pq.write_table(pa.Table.from_pylist(rows), meta)
    msg = one_line_error(out)
    assert "episode 2 has 4 frames" in msg and "length=6" in msg


def test_episode_index_gap(written, tmp_path):
    out = copy_of(written, tmp_path)
    meta = out / "meta/episodes/chunk-000/file-000.parquet"
    rows = pq.read_table(meta).to_pylist()
    pq.write_table(pa.Table.from_pylist([rows[0], rows[2]]), meta)
    msg = one_line_error(out)
    assert "episode_index=2 where 1 was due" in msg and "0 .. 2 without gaps" in msg


def test_truncated_parquet(written, tmp_path):
    out = copy_of(written, tmp_path)
    data = out / "data/chunk-000/file-000.parquet"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    msg = one_line_error(out)
    assert str(data) in msg and "not a readable parquet file" in msg and "truncated" in msg


def without_info(out):
    (out / "meta/info.json").unlink()
    return out


def with_info(out, **changes):
    info = json.loads((out / "meta/info.json").read_text())
    (out / "meta/info.json").write_text(json.dumps({**info, **changes}))
    return out


def with_action(out, index, dim, value):
    """The dataset with frame `index` (over all episodes) of the data file acting `value` in `dim`;
    meta/stats.json is left as it was."""
    data = out / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    column = table["action"].combine_chunks()
    values = column.flatten().to_numpy().reshape(len(column), -1).copy()
    values[index, dim] = value
    action = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), values.shape[1])
    pq.write_table(table.set_column(table.schema.get_field_index("action"), "action", action), data)
    return out


def test_missing_info_json_is_named_as_a_lerobot_dataset_missing_it(written, tmp_path):
    out = without_info(copy_of(written, tmp_path))
    for read in (lambda: read_demos(out, SPEC),
                 lambda: load_samples(load_config(str(PIXEL), [f"sft.data={out}", f"logging.output_dir={tmp_path}"]))):
        with pytest.raises(DemoError) as e:
            read()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{out / 'meta/info.json'}: missing")
        assert "LeRobot's layout (meta/, data/)" in msg and "trajectory" not in msg, msg


@pytest.mark.parametrize("fps", [-5, 0, "30", None, True])
def test_fps_must_be_a_positive_number(written, tmp_path, fps):
    msg = one_line_error(with_info(copy_of(written, tmp_path), fps=fps))
    assert str(tmp_path / "ds/meta/info.json") in msg
    assert f"key 'fps'={fps!r}; allowed: a number > 0" in msg


@pytest.mark.parametrize("value, shown", [(1e30, "1e+30"), (-2e6, "-2e+06"), (float("nan"), "nan")])
def test_an_action_no_robot_takes_names_its_episode_and_frame(written, tmp_path, value, shown):
    """Frame 3 of episode 1 is index 8 (episode 0 has 5 frames); the stats stay ordinary, so the
    frame is refused as it is read."""
    out = with_action(copy_of(written, tmp_path), 8, 1, value)
    msg = one_line_error(out, mapping=LeRobotConfig())
    assert msg.startswith(f"{out / 'data/chunk-000/file-000.parquet'}: episode 1, frame 3: action[1]={shown}; ")
    assert "allowed: finite, |value| <= 1e+06" in msg
    LeRobotSource(with_action(out, 8, 1, 1e6), SPEC, EXACT).read()           # the limit itself is taken


def test_stats_widened_by_an_outlier_are_refused_before_decoding(tmp_path):
    """As the issue found it: one action of 1e30, written (and counted in meta/stats.json) by the
    writer. With action_norm=stats the range's end is refused at once; without, the frame."""
    episodes = made_up_episodes((5, 7, 4))
    episodes[2].actions[1, 0] = 1e30
    out = write_lerobot(tmp_path / "ds", episodes, fps=10, camera="base_camera")
    msg = one_line_error(out, mapping=LeRobotConfig())
    assert msg.startswith(f"{out / 'meta/stats.json'}: action.q99[0]=")
    assert "the action range's high end in dimension 0; allowed: |value| <= 1e+06" in msg
    assert "episode 2, frame 1: action[0]=1e+30" in one_line_error(out)


# ----------------------------------------------------------------------------- the commands
def test_collect_lerobot_and_convert_read_back(tmp_path, capsys):
    cfg = load_config(str(PIXEL))
    episodes, _ = collect_demos(cfg, num_episodes=3, action_noise=0.2, seed=5, num_envs=3)
    write_demos(tmp_path / "h5", episodes, env_info(cfg))
    assert cli.main(["convert", str(tmp_path / "h5"), "--out", str(tmp_path / "conv"), "--fps", "10"]) == 0
    pixel = DemoSpec(image_size=64, action_dim=2)
    converted = LeRobotSource(tmp_path / "conv", pixel, EXACT).read()
    assert [e.num_steps for e in converted] == [e.num_steps for e in episodes]
    for ours, back in zip(episodes, converted):
        np.testing.assert_array_equal(back.actions, ours.actions)
        assert back.instruction == ours.instruction
        err = pixel_error(back.images[:-1], ours.images[:-1])
        assert err < MAX_PIXEL_ERROR, f"mean abs pixel error {err:.2f}"

    assert cli.main(["collect", str(PIXEL), "--episodes", "2", "--out", str(tmp_path / "col"),
                     "--format", "lerobot", "collect.num_envs=2"]) == 0
    collected = LeRobotSource(tmp_path / "col", pixel, LeRobotConfig()).read()
    assert len(collected) == 2 and not (tmp_path / "col" / "trajectory.h5").exists()
    assert cli.main(["convert", str(tmp_path / "col"), "--out", str(tmp_path / "x")]) == 2
    assert "asyncvla convert:" in capsys.readouterr().err


def test_sft_trains_on_a_lerobot_dataset(tmp_path):
    cfg = load_config(str(PIXEL))
    episodes, _ = collect_demos(cfg, num_episodes=4, action_noise=0.2, seed=9, num_envs=4)
    write_lerobot(tmp_path / "ds", episodes, fps=10, camera=cfg.env.camera)
    r = subprocess.run(
        [sys.executable, "-m", "asyncvla.launch.cli", "sft", str(PIXEL), f"sft.data={tmp_path / 'ds'}",
         "sft.steps=2", "sft.eval_interval=0", "sft.eval_episodes=2", "sft.batch_size=8", "sft.val_fraction=0.25",
         "sft.action_range=q99", f"logging.output_dir={tmp_path}", "logging.experiment_name=s"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = tmp_path / "s" / "sft"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["demo_episodes"] == 4 and summary["steps"] == 2
    assert summary["demo_steps"] == sum(e.num_steps for e in episodes)
    q = json.loads((tmp_path / "ds" / "meta" / "stats.json").read_text())["action"]
    saved = VLAPolicy.from_pretrained(run / "policy").cfg         # the dataset's range, not the demos' q99
    np.testing.assert_allclose([saved.action_low, saved.action_high], [q["q01"], q["q99"]], rtol=1e-6)
    assert summary["action_range"]["source"] == "q01/q99"
    assert "action range from the dataset's stats (q01/q99)" in r.stderr

    # A dataset whose actions the policy cannot take stops before any decoding, in one line (which
    # `asyncvla sft` prints, as it does every DemoError).
    with pytest.raises(DemoError) as e:
        load_samples(load_config(str(PIXEL), [f"sft.data={tmp_path / 'ds'}", "policy.action_dim=3"]))
    assert "\n" not in str(e.value) and "policy.action_dim=3" in str(e.value) and "shape [2]" in str(e.value)


@pytest.mark.parametrize("case, words", [
    ("no_info", ["meta/info.json: missing", "LeRobot's layout"]),
    ("fps", ["meta/info.json", "key 'fps'=0"]),
    ("action", ["data/chunk-000/file-000.parquet", "episode 1, frame 3: action[0]=1e+30"]),
])
def test_sft_command_refuses_a_broken_dataset_in_one_line(written, tmp_path, capsys, case, words):
    """The three breakages above, through `asyncvla sft`: exit 2, one line, no traceback."""
    out = copy_of(written, tmp_path)
    {"no_info": without_info, "fps": lambda o: with_info(o, fps=0),
     "action": lambda o: with_action(o, 8, 0, 1e30)}[case](out)
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "sft", str(PIXEL), f"sft.data={out}",
                        "sft.steps=1", "sft.eval_episodes=1", f"logging.output_dir={tmp_path}"],   # (short if taken)
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("asyncvla sft:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr[-2000:]
    if case == "no_info":                               # convert names the same directory the same way
        assert cli.main(["convert", str(out), "--out", str(tmp_path / "x")]) == 2
        assert words[0] in capsys.readouterr().err


def test_sft_samples_stream_from_disk(tmp_path):
    """SFT decodes a LeRobot dataset one episode at a time into frames mapped from a file: the
    memory it takes stays far below the dataset's frames, and the samples are those of the
    episodes read whole into memory (instructions of several tasks kept with their frames)."""
    import tracemalloc

    lengths = (20,) * 30
    write_lerobot(tmp_path / "ds", made_up_episodes(lengths), fps=10, camera="base_camera")
    cfg = load_config(str(PIXEL), [f"sft.data={tmp_path / 'ds'}", "sft.lerobot.action_norm=none",
                                   f"logging.output_dir={tmp_path}", "logging.experiment_name=s"])
    tracemalloc.start()
    samples, norm = load_samples(cfg)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    frame_bytes = sum(lengths) * 64 * 64 * 3
    assert isinstance(samples.images, np.memmap) and norm is None
    assert peak < frame_bytes / 4, f"peak {peak} B while loading {frame_bytes} B of frames"

    whole = LeRobotSource(tmp_path / "ds", DemoSpec(image_size=64, action_dim=2), EXACT).read()
    expected = build_samples(whole, cfg.policy.num_action_chunks, cfg.algorithm.gamma,
                             cfg.algorithm.reward_type, None)
    np.testing.assert_array_equal(samples.images, expected.images)
    np.testing.assert_array_equal(samples.actions, expected.actions)
    assert samples.instructions == expected.instructions and samples.num_episodes == 30

    train, val = split_by_episode(samples, samples.num_episodes, 0.3, seed=1)
    assert train.images is samples.images                   # a split shares the frames
    rows = np.array([0, len(val) - 1])
    np.testing.assert_array_equal(val.frames(rows), expected.images[np.flatnonzero(np.isin(
        expected.episode, np.unique(val.episode)))[rows]])
    assert [val.instructions[i] for i in rows] == [f"reach target {e % 2}" for e in val.episode[rows]]
