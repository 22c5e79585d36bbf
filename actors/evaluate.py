"""Evaluation: run a policy on fixed initial states; success rate, return and length with 95% CIs.

    summary = evaluate_policy(policy, cfg.env, cfg.policy, episodes=16, greedy=True, seed=0,
                              video_dir="videos")          # also: periodic_eval(...) for the learner
    print(format_summary(summary))

Episodes run in rounds of `num_envs` envs with auto-reset off. Round r resets every env with a
seed derived from (seed, r) and the env's fixed reset states, so two evaluations with the same
seed, episode count and num_envs start from the same initial states whatever the policy. An
episode's video holds its first frame and one frame per action chunk (envs are stepped a chunk at
a time), with the instruction and the running return written above the scene.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import textwrap
import time
from pathlib import Path

import numpy as np

from asyncvla.actors.envs import make_env
from asyncvla.actors.envs.tasks import instructions_in, one_task, tasks_of
from asyncvla.actors.rollout import InstructionCache
from asyncvla.common.config import EvalConfig
from asyncvla.common.trackers import Trackers

Z95 = 1.959964                  # two-sided 95% normal quantile
DEFAULT_NUM_ENVS = EvalConfig.num_envs   # envs per round: ManiSkill on the CPU runs one process per env
VIDEO_FPS = 4                   # frames are action chunks, not env steps
MIN_VIDEO_WIDTH = 256           # small scenes are upscaled (nearest) so the caption stays legible
MACRO_BLOCK = 16                # H.264 wants frame sides in multiples of 16


def evaluate_policy(policy, env_cfg, policy_cfg, episodes: int, greedy: bool = True, seed: int = 0,
                    video_dir=None, num_envs: int | None = None, instruction_set: str = "train") -> dict:
    """Run `episodes` episodes of each task of `env_cfg` (env.tasks, or env.id) and return the
    summary (see `summarize`; several tasks: pooled over them, the same number each, and each
    task's under "tasks"), with one record per episode under "episodes" and, with `video_dir`, one
    mp4 per episode written there. `instruction_set` (tasks.INSTRUCTION_SETS): what each task's
    envs tell the policy: its training sentence, its held-out phrasing (eval), or the next task's
    training sentence (swapped: a policy that reads the instruction should then fail)."""
    if episodes < 1:
        raise ValueError(f"episodes={episodes} must be >= 1")
    t0 = time.perf_counter()
    tasks = tasks_of(env_cfg)
    records, per_task = [], {}
    for task, text in zip(tasks, instructions_in(tasks, instruction_set)):
        task_videos = None if video_dir is None else Path(video_dir) / (task.id if len(tasks) > 1 else "")
        found = _evaluate_task(policy, one_task(env_cfg, task, text), policy_cfg, episodes, greedy, seed,
                               task_videos, num_envs, first_episode=len(records))
        for rec in found:
            rec["task"] = task.id
        per_task[task.id] = summarize(found)
        records += found
    summary = summarize(records)
    if len(tasks) > 1:
        summary["tasks"] = per_task
    summary.update(env_id=",".join(per_task), instruction_set=instruction_set, greedy=greedy,
                   temperature=policy.temperature, seed=seed, num_envs=min(episodes, num_envs or DEFAULT_NUM_ENVS),
                   eval_s=round(time.perf_counter() - t0, 3), episodes=records)
    return summary


def _evaluate_task(policy, env_cfg, policy_cfg, episodes: int, greedy: bool, seed: int, video_dir,
                   num_envs: int | None, first_episode: int) -> list[dict]:
    """The records of `episodes` episodes of the one task of `env_cfg`."""
    num_envs = min(episodes, num_envs or DEFAULT_NUM_ENVS)
    # Episodes end at success even where training ignores terminations: success counts at any
    # step either way, and ending there skips the rest of the episode.
    env_cfg = dataclasses.replace(env_cfg, auto_reset=False, use_proprio=policy_cfg.state_dim > 0,
                                  ignore_terminations=False)
    K, D = policy_cfg.num_action_chunks, policy_cfg.action_dim
    tokenize = InstructionCache(policy)
    generator = None
    if not greedy:
        import torch
        generator = torch.Generator().manual_seed(seed)
    if video_dir is not None:
        Path(video_dir).mkdir(parents=True, exist_ok=True)
    records = []
    env = make_env(env_cfg, num_envs, policy_cfg.image_size, K, "chunk_level", seed, action_dim=D, purpose="evaluate")
    try:
        for r in range(math.ceil(episodes / num_envs)):
            wanted = min(num_envs, episodes - len(records))
            records += _run_round(env, policy, tokenize, round_seed(seed, r), wanted, (K, D), greedy,
                                  generator, video_dir, first_episode=first_episode + len(records))
    finally:
        env.close()
    return records


def _run_round(env, policy, tokenize, reset_seed, wanted, chunk_shape, greedy, generator, video_dir,
               first_episode) -> list[dict]:
    """One episode in each of the first `wanted` envs, from the initial states of `reset_seed`."""
    obs = env.reset(seed=reset_seed)
    instructions = list(env.instructions)
    active = np.arange(env.num_envs) < wanted
    ended: dict[int, dict] = {}
    returns = np.zeros(env.num_envs)
    frames = [[(f, "chunk 0")] for f in env.render_frames()] if video_dir is not None else None
    chunk = 0
    while active.any():
        idx = np.flatnonzero(active)
        ids, mask = tokenize([instructions[i] for i in idx])
        state = obs["state"][idx] if "state" in obs else None
        out = policy.act(obs["image"][idx], ids, mask, state, greedy=greedy, generator=generator)
        actions = np.zeros((env.num_envs, *chunk_shape), np.float32)   # envs not acting stay put
        actions[idx] = out.actions
        step = env.step_chunk(actions)
        chunk += 1
        returns += np.asarray(step.reward).reshape(env.num_envs, -1).sum(1)
        if frames is not None:
            shown = env.render_frames()
            for i in idx:
                frames[i].append((shown[i], f"chunk {chunk}  return {returns[i]:+.2f}"))
        for ep in step.episodes:
            if active[ep["env"]]:
                ended[ep["env"]] = ep
                active[ep["env"]] = False
        obs = step.obs
    records = []
    for i in range(wanted):
        ep = ended[i]
        rec = {"episode": first_episode + i, "seed": reset_seed, "env": i,
               "instruction": instructions[i], "return": ep["return"], "length": ep["length"],
               "success": ep["success"], "video": None}
        if frames is not None:
            path = Path(video_dir) / f"episode_{rec['episode']:04d}.mp4"
            last, status = frames[i][-1]
            frames[i][-1] = (last, status + ("  success" if ep["success"] else "  failure"))
            write_video(path, frames[i], instructions[i])
            rec["video"] = path.name
        records.append(rec)
    return records


def round_seed(seed: int, r: int) -> int:
    """The reset seed of round r of an evaluation with `seed`."""
    return int(np.random.SeedSequence([seed, r]).generate_state(1)[0] & 0x7FFFFFFF)


# ----------------------------------------------------------------------------------- statistics
def summarize(records: list[dict]) -> dict:
    """Success rate with its Wilson interval; mean return and length with normal intervals."""
    n = len(records)
    wins = sum(bool(r["success"]) for r in records)
    returns = [float(r["return"]) for r in records]
    lengths = [float(r["length"]) for r in records]
    return {"num_episodes": n, "success_rate": wins / n, "success_ci95": wilson_interval(wins, n),
            "return_mean": float(np.mean(returns)), "return_ci95": normal_interval(returns),
            "length_mean": float(np.mean(lengths)), "length_ci95": normal_interval(lengths)}


def wilson_interval(successes: int, n: int, z: float = Z95) -> list[float]:
    """Wilson score interval of a binomial proportion: sensible at 0 or n successes, unlike p +- z*se."""
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def normal_interval(values, z: float = Z95) -> list[float] | None:
    """mean +- z * standard error; None for fewer than two values (no spread to estimate)."""
    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return None
    half = z * x.std(ddof=1) / math.sqrt(len(x))
    return [float(x.mean() - half), float(x.mean() + half)]


def format_summary(s: dict) -> str:
    def ci(lo_hi, fmt):
        return "[n/a]" if lo_hi is None else f"[{lo_hi[0]:{fmt}}, {lo_hi[1]:{fmt}}]"
    mode = "greedy" if s["greedy"] else f"sampled at temperature {s['temperature']:g}" if "temperature" in s \
        else "sampled"
    words = "" if s.get("instruction_set", "train") == "train" else f", {s['instruction_set']} instructions"
    tasks = [f"  {name:24s}  {t['success_rate']:.3f}  95% CI {ci(t['success_ci95'], '.3f')}  "
             f"({t['num_episodes']} episodes)" for name, t in s.get("tasks", {}).items()]
    return "\n".join([
        f"{s['env_id']}: {s['num_episodes']} episodes ({mode} actions{words}, seed {s['seed']}, "
        f"{s['eval_s']:.1f} s)", *tasks,
        f"  success rate  {s['success_rate']:.3f}  95% CI {ci(s['success_ci95'], '.3f')} (Wilson"
        + (", the tasks pooled: their mean)" if tasks else ")"),
        f"  return        {s['return_mean']:.3f}  95% CI {ci(s['return_ci95'], '.3f')}",
        f"  length        {s['length_mean']:.1f}  95% CI {ci(s['length_ci95'], '.1f')} env steps"])


def write_summary(path, summary: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------------------------- video
def write_video(path, frames: list[tuple[np.ndarray, str]], instruction: str, fps: int = VIDEO_FPS) -> None:
    """frames: (uint8 [h,w,3] scene, status line) pairs -> an H.264 mp4 with a caption band above
    each scene (the instruction, then the status)."""
    import imageio.v2 as imageio

    h, w = frames[0][0].shape[:2]
    scale = max(1, math.ceil(MIN_VIDEO_WIDTH / w))
    width = _round_up(w * scale, MACRO_BLOCK)
    font = _font()
    chars = max(8, int(width / max(font.getlength("n"), 1)) - 1)
    lines = textwrap.wrap(instruction, chars) or [""]
    line_h = font.getbbox("Ag")[3] + 4
    top = _round_up(h * scale + line_h * (len(lines) + 1) + 6, MACRO_BLOCK) - h * scale
    with imageio.get_writer(str(path), fps=fps, codec="libx264", macro_block_size=MACRO_BLOCK,
                            ffmpeg_log_level="error") as writer:
        for scene, status in frames:
            writer.append_data(_captioned(scene, scale, width, top, lines + [status], line_h, font))


def _captioned(scene, scale, width, top, lines, line_h, font) -> np.ndarray:
    from PIL import Image, ImageDraw

    big = np.repeat(np.repeat(scene, scale, 0), scale, 1)
    canvas = np.zeros((top + big.shape[0], width, 3), np.uint8)
    canvas[top:, :big.shape[1]] = big
    img = Image.fromarray(canvas)
    draw = ImageDraw.Draw(img)
    for k, line in enumerate(lines):
        draw.text((4, 3 + k * line_h), line, fill=(255, 255, 255), font=font)
    return np.asarray(img)


def _font():
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=14)
    except TypeError:           # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@contextlib.contextmanager
def one_torch_thread():
    """torch's intra-op pool at one thread for the block, then as it was. For the evaluations that
    share the machine with training or with other jobs: the pixel task's 256 episodes at 32 px took
    7.0 s on one thread, and on two 5.7 s with both cores idle but 17.8 s beside one busy core (the
    two threads wait on each other). ManiSkill's evaluations wait on their env processes: the same
    either way."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -------------------------------------------------------------------------------- during training
def periodic_eval(policy, cfg, step: int, run_dir, writer=None) -> dict:
    """Evaluate `policy` (a plain, un-partitioned copy, e.g. one holding the published weights) as
    `cfg.eval` says; write run_dir/eval/step_N/summary.json (+ videos with eval.save_video) and log
    eval/success_rate (with env.tasks also eval/success_rate/<task>), eval/return, eval/length at
    `step` to `writer` if given (common/trackers.py,
    or a tensorboard SummaryWriter), and the first episode's video to the backends that take
    videos."""
    out_dir = Path(run_dir) / "eval" / f"step_{step:08d}"
    with one_torch_thread():            # (SFT evaluates between its steps, with its threads)
        summary = evaluate_policy(policy, cfg.env, cfg.policy, cfg.eval.num_episodes, cfg.eval.greedy,
                                  seed=cfg.env.seed, video_dir=out_dir if cfg.eval.save_video else None,
                                  num_envs=cfg.eval.num_envs)
    summary["step"] = step
    write_summary(out_dir / "summary.json", summary)
    if writer is not None:
        for tag, key in (("eval/success_rate", "success_rate"), ("eval/return", "return_mean"),
                         ("eval/length", "length_mean")):
            writer.add_scalar(tag, summary[key], step)
        for name, task in summary.get("tasks", {}).items():        # env.tasks: each task's
            writer.add_scalar(f"eval/success_rate/{name}", task["success_rate"], step)
        videos = sorted(out_dir.rglob("*.mp4"))
        if videos and isinstance(writer, Trackers):
            writer.add_video("eval/video", videos[0], step)
        writer.flush()
    return summary
