"""Supervised fine-tuning (SFT) on demonstrations: the warm start before RL.

    asyncvla sft CONFIG sft.data=DEMO_DIR [key=value ...]

It trains the RL learner's own policy on the RL learner's own DeepSpeed ZeRO-3 engine
(`engine.build_engine`) and checkpoints with the same code (`checkpoint.save/load`). The loop:
    a minibatch of demo samples (learner/sft_data.py)
    loss = the action head's supervised loss on the demo's action chunk (its `sft_loss`: a token
           head's cross-entropy of the demo's tokens, a flow head's flow-matching loss, a Gaussian
           head's negative log-likelihood)
         + value_loss_coef * (V(x) - G)^2        (critic warm-up on the demos' discounted returns)
    every eval_interval and at the end: validation loss, the head's statistics (a token head's
        token accuracy), critic explained variance,
        and success of the policy sampled as actors sample (the launcher's `evaluate` callback)
    every save_interval: a checkpoint; a rerun continues from the latest complete one
At the end the policy goes to RUN/sft/policy (`save_pretrained`), which `policy.pretrained_path`,
`asyncvla eval` and `asyncvla export` take. Metrics go to tensorboard under sft/*.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from asyncvla.common.config import Config, to_dict, to_yaml
from asyncvla.common.data.demos import DemoSpec, camera_settings, read_demos
from asyncvla.common.data.lerobot import is_lerobot
from asyncvla.common.policy import build_policy, load_policy
from asyncvla.common.rundir import run_dir
from asyncvla.common.trackers import open_trackers
from asyncvla.learner import checkpoint, engine as ds_engine
from asyncvla.learner.publish import gather_trainable
from asyncvla.learner.sft_data import (SFTSamples, action_range_q99, build_samples, random_shift,
                                       split_by_episode)

log = logging.getLogger("asyncvla.sft")

SFT_DIR = "sft"
POLICY_DIR = "policy"
SUMMARY = "summary.json"


def sft_dir(cfg: Config) -> Path:
    return run_dir(cfg) / SFT_DIR


def demo_spec(cfg: Config) -> DemoSpec:
    """What demo files must match for this config (a file without a control mode is not checked)."""
    return DemoSpec(camera=cfg.env.camera, image_size=cfg.policy.image_size,
                    action_dim=cfg.policy.action_dim, control_mode=cfg.env.control_mode, env_id=cfg.env.id,
                    state_dim=cfg.policy.state_dim,
                    camera_settings=tuple(sorted(camera_settings(cfg.env).items())))


def load_samples(cfg: Config, progress: bool = False,
                 default_instruction: Optional[str] = None) -> tuple[SFTSamples, Optional[dict]]:
    """The samples of sft.data's episodes and, from a LeRobot dataset's stats, the action range a
    new policy bins over ({"low", "high", "source"}; None: sft.action_range decides).

    A directory with meta/info.json is a LeRobot dataset (sft.lerobot maps it): its episodes are
    decoded one at a time into a frame store on disk, so a dataset larger than memory trains.
    Anything else is ManiSkill's trajectory files, read into memory."""
    sc, K, gamma = cfg.sft, cfg.policy.num_action_chunks, cfg.algorithm.gamma
    instruction = default_instruction or cfg.env.instruction
    if not is_lerobot(sc.data):
        episodes = read_demos(sc.data, demo_spec(cfg), max_steps=sc.max_demo_steps)
        return build_samples(episodes, K, gamma, cfg.algorithm.reward_type, instruction), None
    from asyncvla.common.data.lerobot.read import LeRobotSource
    source = LeRobotSource(sc.data, demo_spec(cfg), sc.lerobot)
    frames = frame_store(source.num_steps(sc.max_demo_steps), cfg.policy.image_size, sft_dir(cfg))
    samples = build_samples(source.episodes(sc.max_demo_steps, progress), K, gamma, cfg.algorithm.reward_type,
                            instruction, frames=frames)
    return samples, source.action_range


def frame_store(count: int, size: int, directory: Path) -> np.ndarray:
    """uint8 [count, size, size, 3] in a nameless temporary file in `directory`, mapped into memory:
    the kernel keeps what fits in memory and reads the rest back as batches need it. The file is
    gone when the process ends."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory) as f:      # (the mapping keeps it open)
        return np.memmap(f, np.uint8, "w+", shape=(count, size, size, 3))


def sft_loss(policy_loss: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
             value_loss_coef: float) -> tuple[torch.Tensor, dict]:
    """Mean of the per-sample policy losses (the head's `sft_loss`) + value_loss_coef * mean
    squared error of V against the returns."""
    ce = policy_loss.mean()
    value_loss = (values - returns).pow(2).mean()
    loss = ce + value_loss_coef * value_loss
    return loss, {"loss": float(ce.detach()), "value_loss": float(value_loss.detach())}


def explained_variance(pred: np.ndarray, target: np.ndarray) -> float:
    """1 - Var(target - pred) / Var(target); nan when the target does not vary."""
    var = float(np.var(target))
    return float("nan") if var == 0 else 1.0 - float(np.var(target - pred)) / var


def run(cfg: Config, evaluate: Optional[Callable] = None, default_instruction: Optional[str] = None,
        progress: bool = True) -> Path:
    """Train, evaluate, checkpoint; return the policy directory written at the end.

    evaluate(policy, step) -> an `actors.evaluate` summary (success_rate, success_ci95), on rank 0;
    default_instruction: for demo episodes that carry none (files from ManiSkill's tools)."""
    ds_engine.init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    out, sc = sft_dir(cfg), cfg.sft
    if sc.batch_size % world:
        raise ValueError(f"sft.batch_size={sc.batch_size} must be a multiple of the ranks ({world})")
    samples, data_range = load_samples(cfg, progress and rank == 0, default_instruction)
    train, val = split_by_episode(samples, samples.num_episodes, sc.val_fraction, sc.seed)
    log.info("%d demo episodes, %d steps: %d train / %d validation samples", samples.num_episodes,
             len(samples), len(train), len(val) if val is not None else 0)

    torch.manual_seed(sc.seed)
    init_dir = _initial_policy(cfg, samples, data_range, out / "policy_init", rank)
    policy, spec, per_rank = load_policy(init_dir), engine_spec(cfg), sc.batch_size // world
    accum = -(-per_rank // spec.micro_batch_size)
    engine = ds_engine.build_engine(policy, spec, gradient_accumulation_steps=accum)
    ids, mask = _tokenize(policy, train.instructions)          # rows of train, and of val below
    val_text = _tokenize(policy, val.instructions) if val is not None else (None, None)
    step, history = _continue(engine, out)
    writer = open_trackers(cfg, out, "sft") if rank == 0 else None
    eval_policy = load_policy(init_dir) if rank == 0 else None
    rng = np.random.default_rng([sc.seed, step])
    bar = _bar(sc.steps, step, progress and rank == 0)
    t0 = time.perf_counter()
    while step < sc.steps:
        batch = rng.choice(len(train), sc.batch_size, replace=len(train) < sc.batch_size)
        mine = batch[rank * per_rank:(rank + 1) * per_rank]      # every rank draws the same batch
        lr = ds_engine.group_lrs(engine)["policy"]              # (what this step runs at)
        stats = _train_step(engine, train, mine, ids, mask, cfg, accum, rng)
        step += 1
        _log_step(writer, bar, stats, lr, step)
        last = step == sc.steps
        if last or (sc.eval_interval and step % sc.eval_interval == 0):
            if evaluate is not None:       # (minutes on ManiSkill: say so rather than look stuck)
                bar.set_description(f"sft: evaluating on {sc.eval_episodes} episodes", refresh=True)
            record = _evaluate(engine, eval_policy, val, *val_text, cfg, spec.micro_batch_size, step, evaluate)
            record.update(step=step, wall_s=round(time.perf_counter() - t0, 1))
            history.append(record)
            _log_record(writer, bar, record, step)
        if last or step % sc.save_interval == 0:
            checkpoint.save(engine, out, step, {"step": step, "config": to_dict(cfg), "history": history},
                            keep_last=1)
    bar.close()
    return _finish(cfg, engine, eval_policy, writer, out, step, samples, data_range, history)


def _initial_policy(cfg: Config, samples: SFTSamples, data_range: Optional[dict], init_dir: Path, rank: int) -> Path:
    """RUN/sft/policy_init, built once by rank 0: a new policy bins actions over the dataset's stats'
    range, or with sft.action_range q99 the demos' (a saved policy keeps its own range)."""
    if rank == 0 and not (init_dir / "policy.json").exists():
        policy_cfg = cfg.policy
        if data_range is not None:
            policy_cfg = dataclasses.replace(policy_cfg, action_low=data_range["low"], action_high=data_range["high"])
            log.info("action range from the dataset's stats (%s): low %s high %s", data_range["source"],
                     data_range["low"], data_range["high"])
        elif cfg.sft.action_range == "q99":
            low, high = action_range_q99(samples.actions[:, 0])
            policy_cfg = dataclasses.replace(policy_cfg, action_low=low, action_high=high)
            log.info("action range from the demos (q01 .. q99): low %s high %s", low, high)
        build_policy(policy_cfg).save_pretrained(init_dir)
    dist.barrier()
    return init_dir


def _continue(engine, out: Path) -> tuple[int, list]:
    """(step, history) of the latest complete SFT checkpoint, loaded into `engine`; (0, []) without one."""
    latest = checkpoint.find_latest(out) if (out / checkpoint.CHECKPOINTS).exists() else None
    if latest is None:
        return 0, []
    state = checkpoint.load(engine, latest)
    log.info("continuing SFT from %s (step %d)", latest, int(state["step"]))
    return int(state["step"]), list(state.get("history", []))


def _log_step(writer, bar, stats: dict, lr: float, step: int) -> None:
    if writer is not None:
        for k, v in stats.items():
            writer.add_scalar(f"sft/train_{k}", v, step)
        writer.add_scalar("sft/lr", lr, step)
    bar.set_postfix_str(f"loss {stats['loss']:.3f}" + (f" acc {stats['token_accuracy']:.2f}"
                                                          if "token_accuracy" in stats else ""))
    bar.update(1)


def _log_record(writer, bar, record: dict, step: int) -> None:
    bar.set_description("sft", refresh=False)
    if writer is not None:
        writer.add_scalars(record_scalars(record), step)
        writer.flush()
    bar.write(_format(record))


def record_scalars(record: dict) -> dict:
    """An evaluation record's tensorboard scalars: sft/<key>, and with env.tasks each task's
    success as sft/success_rate/<task> (as `asyncvla eval` logs eval/success_rate/<task>)."""
    out = {f"sft/{k}": v for k, v in record.items()
           if k not in ("step", "wall_s", "tasks") and v is not None}
    out.update({f"sft/success_rate/{k}": t["success_rate"] for k, t in record.get("tasks", {}).items()})
    return out


def _finish(cfg: Config, engine, eval_policy, writer, out: Path, step: int, samples: SFTSamples,
            data_range: Optional[dict], history: list) -> Path:
    """RUN/sft/policy (with the config `asyncvla eval` takes the env from) and summary.json, by rank 0."""
    policy_dir = out / POLICY_DIR
    weights = gather_trainable(engine)
    if dist.get_rank() == 0:
        eval_policy.load_trainable_state_dict(weights)
        eval_policy.save_pretrained(policy_dir)
        (policy_dir / "config.yaml").write_text(to_yaml(cfg))
        summary = {"steps": step, "demo_episodes": samples.num_episodes, "demo_steps": len(samples),
                   "history": history}
        if data_range is not None:
            summary["action_range"] = data_range
        (out / SUMMARY).write_text(json.dumps(summary, indent=2))
        writer.close()
    dist.barrier()
    return policy_dir


# ----------------------------------------------------------------------------------- helpers
def engine_spec(cfg: Config) -> ds_engine.EngineSpec:
    """SFT's engine. Its optimiser and schedule come from sft.* alone: a constant sft.lr /
    sft.value_lr, no warm-up and no decay, on the default config's optimiser for the rest. From
    learner.* it takes only how the engine runs: precision, and the ZeRO stage and micro-batch
    where sft.* leaves them null. (A copy of learner.* with some fields reset once let every other
    key leak in: learner.lr_decay_style=linear decayed SFT's lr to 0.)"""
    sc, learner = cfg.sft, cfg.learner
    return dataclasses.replace(ds_engine.EngineSpec.rl(Config()), lr=sc.lr, value_lr=sc.value_lr,
                               precision=learner.precision,
                               zero_stage=learner.zero_stage if sc.zero_stage is None else sc.zero_stage,
                               micro_batch_size=sc.micro_batch_size or learner.micro_batch_size)


def _tokenize(policy, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and masks per sample, tokenizing each distinct instruction once."""
    unique = sorted(set(texts))
    ids, mask = policy.tokenize(unique)
    row = {t: i for i, t in enumerate(unique)}
    index = np.array([row[t] for t in texts])
    return ids[index], mask[index]


def _forward(engine, data: SFTSamples, index, ids, mask, cfg: Config, rng=None, seed: int = 0):
    """The head's supervised loss on samples `index` of `data` (ids/mask are indexed by data's
    rows); with `rng` (training), images get sft.augment_shift. Returns (per-sample losses [n],
    values, returns, per-sample stats {name: [n]}); what the head draws (a flow head's noise and
    times) comes from `rng`, else from `seed`."""
    device = next(engine.module.parameters()).device
    t = lambda x: torch.as_tensor(np.ascontiguousarray(x), device=device)   # noqa: E731
    state = None if data.states is None else t(data.states[index])
    images = data.frames(index)
    if rng is not None:
        images = random_shift(images, cfg.sft.augment_shift, rng)
    gen = None
    if engine.module.head.sft_draws:      # (else no draw from rng: the demo batches stay as they were)
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)) if rng is not None else seed)
    out = engine(t(images), t(ids[index]), t(mask[index]), state, demo_actions=t(data.actions[index]), generator=gen)
    return out.loss, out.values, t(data.returns[index]).float(), out.stats


def _train_step(engine, data: SFTSamples, index, ids, mask, cfg: Config, accum: int,
                rng: np.random.Generator) -> dict:
    engine.train()
    sums = {"loss": 0.0, "value_loss": 0.0}
    micro = np.array_split(index, accum)
    for rows in micro:
        losses, values, returns, head_stats = _forward(engine, data, rows, ids, mask, cfg, rng)
        loss, stats = sft_loss(losses, values, returns, cfg.sft.value_loss_coef)
        engine.backward(loss * (len(rows) * accum / len(index)))     # DeepSpeed divides by accum
        engine.step()
        stats.update({k: float(v.float().mean()) for k, v in head_stats.items()})
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v * len(rows) / len(index)
    return sums


@torch.no_grad()
def _evaluate(engine, eval_policy, val, ids, mask, cfg: Config, micro: int, step, evaluate) -> dict:
    """Validation loss, the head's statistics (val_<name>), critic explained variance, then
    success (rank 0). Validation runs in SFT's micro-batches (`micro`)."""
    record = {"val_loss": None, "val_token_accuracy": None, "val_explained_variance": None}
    if val is not None:
        engine.eval()
        losses, values, head_stats = [], [], {}
        for i, rows in enumerate(np.array_split(np.arange(len(val)), -(-len(val) // micro))):
            loss, value, _, stats = _forward(engine, val, rows, ids, mask, cfg, seed=i)
            losses.append(loss)
            values.append(value)
            for k, v in stats.items():
                head_stats.setdefault(k, []).append(v.float())
        record["val_loss"] = float(torch.cat(losses).mean())
        record.update({f"val_{k}": float(torch.cat(v).mean()) for k, v in head_stats.items()})
        record["val_explained_variance"] = explained_variance(torch.cat(values).cpu().numpy(), val.returns)
    weights = gather_trainable(engine)         # a collective: every rank
    if eval_policy is not None and evaluate is not None:
        eval_policy.load_trainable_state_dict(weights)
        summary = evaluate(eval_policy, step)
        low, high = summary["success_ci95"]
        record.update(success_rate=summary["success_rate"], success_ci_low=low, success_ci_high=high)
        if "tasks" in summary:                 # env.tasks: each task's figure too
            record["tasks"] = {k: {"success_rate": t["success_rate"], "ci95": t["success_ci95"]}
                               for k, t in summary["tasks"].items()}
    return record


def _format(r: dict) -> str:
    parts = [f"sft step {r['step']}"]
    if r.get("val_loss") is not None:
        acc = "" if r.get("val_token_accuracy") is None else f" acc {r['val_token_accuracy']:.2f}"
        parts.append(f"val loss {r['val_loss']:.3f}{acc} critic EV {r['val_explained_variance']:.2f}")
    if r.get("success_rate") is not None:
        parts.append(f"success {100 * r['success_rate']:.0f}% "
                     f"[{100 * r['success_ci_low']:.0f}, {100 * r['success_ci_high']:.0f}]")
    return ", ".join(parts) + f" ({r['wall_s']:.0f} s)"


def _bar(total: int, start: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=start, desc="sft", unit="step", disable=not enabled,
                dynamic_ncols=True)
