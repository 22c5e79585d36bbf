"""One rank of a small DeepSpeed run for tests/test_engine.py (started once per rank with RANK,
WORLD_SIZE, ... in the environment, or with none of them for a lone rank).

    python tests/ds_worker.py PHASE OUT_DIR

Phases: `train` (ZeRO-3 updates beside an un-sharded reference, gather, EMA, checkpoints),
`resume` (a fresh run loads the newest checkpoint and takes the next update), `errors` (a single
rank meets each kind of bad checkpoint), `policy` (a tiny VLAPolicy trained and checkpointed as
the learner does it, for tests/test_eval_export.py), `update` (the learner's update and report
beside hand computations, for tests/test_update.py), `faults` (saves that fail on one rank, at
ZeRO-2 and 3, then one that succeeds; a really full disk when ASYNCVLA_TINY_DISK names a small
filesystem) and `faults_resume` (fresh ranks resume those: weights and each rank's own random
streams), for tests/test_checkpoint.py. Each rank writes what it saw to
OUT_DIR/<phase>_rank<r>.pt; the tests assert on those records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import copy
import errno
import random
import shutil
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from asyncvla.common.config import Config, to_dict
from asyncvla.learner import checkpoint, engine as ds_engine
from asyncvla.learner.publish import EmaWeights, gather_trainable, partition_elements, trainable_finite

D_IN, WIDTH, RANK, N_OUT, MICRO = 8, 32, 4, 6, 4
GAS = 2                   # micro batches per update on each rank
WARMUP = 6                # LR warm-up updates: still ramping when the checkpoint at update 4 is taken
SAVE_AT = (2, 3, 4)       # updates after which `train` saves (keep_last=2 keeps the last two)
LAST = 5                  # `train` runs this many updates; `resume` redoes the last one


class LowRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(RANK, WIDTH) * 0.3)
        self.b = nn.Parameter(torch.randn(WIDTH, RANK) * 0.3)

    def forward(self, h):
        return h @ self.a.t() @ self.b.t()


class TinyAdapterModel(nn.Module):
    """A frozen base (three Linear layers), a low-rank adapter on the middle one, a value head."""

    def __init__(self):
        super().__init__()
        self.base_in = nn.Linear(D_IN, WIDTH)
        self.base_mid = nn.Linear(WIDTH, WIDTH)
        self.adapter = LowRank()
        self.base_out = nn.Linear(WIDTH, N_OUT)
        self.value_head = nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 1))
        for m in (self.base_in, self.base_mid, self.base_out):
            m.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.base_in(x))
        h = torch.tanh(self.base_mid(h) + self.adapter(h))
        return self.base_out(h), self.value_head(h).squeeze(-1)


def make_config() -> Config:
    cfg = Config()
    lc = cfg.learner
    lc.micro_batch_size, lc.lr, lc.value_lr, lc.lr_warmup_steps = MICRO, 1e-3, 1e-2, WARMUP
    lc.weight_decay, lc.clip_grad, lc.zero_stage, lc.precision = 0.01, 1.0, 3, "fp32"
    lc.rollout_ema_decay, lc.dist_timeout_minutes = 0.5, 77
    cfg.checkpoint.keep_last = 2
    return cfg


def build(cfg: Config, world: int):
    torch.manual_seed(0)                       # the same init on every rank, as in the learner
    model = TinyAdapterModel()
    reference = copy.deepcopy(model)           # full weights, before ZeRO-3 partitions them
    ds = ds_engine.build_ds_config(ds_engine.EngineSpec.rl(cfg), world, GAS)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0    # partition even tiny params
    return ds_engine.build_engine(model, ds_engine.EngineSpec.rl(cfg), GAS, ds_config=ds), reference


def batch(update: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * update + 10 * rank + micro)
    return (torch.randn(MICRO, D_IN, generator=g), torch.randint(0, N_OUT, (MICRO,), generator=g),
            torch.randn(MICRO, generator=g))


def loss_fn(model, x, actions, returns):
    logits, values = model(x.to(next(model.parameters()).dtype))
    logits, values = logits.float(), values.float()
    logp = torch.log_softmax(logits, -1).gather(-1, actions[:, None]).squeeze(-1)
    return -logp.mean() + ((values - returns) ** 2).mean()


def engine_update(engine, update: int, rank: int) -> None:
    for m in range(GAS):
        engine.backward(loss_fn(engine, *batch(update, rank, m)))
        engine.step()


class Reference:
    """The same updates without DeepSpeed: one process sees every rank's micro batches."""

    def __init__(self, model, cfg, world):
        lc = cfg.learner
        self.model, self.world, self.clip = model, world, lc.clip_grad
        groups = [{k: v for k, v in g.items() if k != "name"}
                  for g in ds_engine.param_groups(model, lc.lr, lc.value_lr)]
        self.params = [p for g in groups for p in g["params"]]
        self.opt = torch.optim.AdamW(groups, betas=(lc.adam_beta1, lc.adam_beta2), eps=lc.adam_eps,
                                     weight_decay=lc.weight_decay)
        self.sched = ds_engine.warmup_schedule(lc.lr_warmup_steps)(self.opt)

    def update(self, update: int) -> None:
        self.opt.zero_grad()
        n = self.world * GAS
        for r in range(self.world):
            for m in range(GAS):
                (loss_fn(self.model, *batch(update, r, m)) / n).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.sched.step()

    def trainable(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}


def all_params(engine) -> dict:
    """Every parameter, frozen ones included (test-only: the publisher never gathers the base)."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def padded_partitions(engine) -> dict:
    """Each trainable partition's real elements, and whether the finite check passes while the
    padding that ends a partition holds NaN (as memory DeepSpeed never writes may); the padding is
    zeroed again afterwards."""
    parts, padding = {}, {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            real = partition_elements(p)
            parts[name] = real.clone()
            padding[name] = p.ds_tensor.numel() - real.numel()
            p.ds_tensor[real.numel():] = float("nan")
    finite = trainable_finite(engine)
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            p.ds_tensor[parts[name].numel():] = 0.0
    return {"local_parts": parts, "padding": padding, "finite_despite_nan_padding": finite}


def rng_draws():
    return {"torch": torch.rand(3), "numpy": np.random.rand(3), "python": random.random()}


# ---------------------------------------------------------------------------------------- phases
def phase_train(out: Path, rank: int, world: int) -> dict:
    cfg = make_config()
    run_dir = out / "run"
    engine, ref_model = build(cfg, world)
    ref = Reference(ref_model, cfg, world)
    rec: dict = {"partitioned": all(p.numel() == 0 for p in engine.module.parameters()),
                 "group_names": [g.get("name") for g in engine.optimizer.param_groups],
                 "initial_all": all_params(engine), "ref_all": {n: p.detach().clone()
                                                                for n, p in ref_model.named_parameters()},
                 "gathered": [], "ref": [], "pub0": [], "pub5": [], "lrs": [], "timings": [],
                 "saves": {}, "save_s": []}
    rec.update(padded_partitions(engine))
    ema0, ema5 = (EmaWeights(0.0), EmaWeights(0.5)) if rank == 0 else (None, None)

    def publish():
        t0 = time.perf_counter()
        g = gather_trainable(engine)
        rec["timings"].append({"gather_s": time.perf_counter() - t0})
        rec["gathered"].append(g)
        rec["ref"].append(ref.trainable())
        rec["pub5"].append(ema5.update(g) if ema5 else None)
        rec["pub0"].append(ema0.update(g) if ema0 else None)
        if ema5:
            rec["timings"][-1].update(ema5.timings)

    publish()
    for update in range(1, LAST + 1):
        rec["lrs"].append(ds_engine.group_lrs(engine))          # the LR this update runs at
        engine_update(engine, update, rank)
        ref.update(update)
        publish()
        if update in SAVE_AT:
            state = {"step": update, "version": update, "env_steps": 1000 * update,
                     "rng": checkpoint.rng_state(), "config": to_dict(cfg),
                     "ema": ema5.state_dict() if ema5 else None}
            t0 = time.perf_counter()
            tag_dir = checkpoint.save(engine, run_dir, update, state, keep_last=cfg.checkpoint.keep_last)
            rec["save_s"].append(time.perf_counter() - t0)
            rec["saves"][update] = {"tag_dir": str(tag_dir), "rng_draws": rng_draws(),
                                    "tags_after": sorted(d.name for d in tag_dir.parent.iterdir()
                                                         if d.is_dir())}
    rec["final_all"] = all_params(engine)
    return rec


def phase_resume(out: Path, rank: int, world: int) -> dict:
    cfg = make_config()
    engine, _ = build(cfg, world)
    found = checkpoint.find_latest(out.parent / "train" / "run")
    state = checkpoint.load(engine, found)
    checkpoint.set_rng_state(state["rng"])
    rec = {"found": str(found), "state": state, "rng_draws": rng_draws(),
           "lr_after_load": ds_engine.group_lrs(engine)}
    ema = EmaWeights(cfg.learner.rollout_ema_decay) if rank == 0 else None
    if ema is not None:
        ema.load_state_dict(state["ema"])
        rec["ema_shadow"] = {k: v.clone() for k, v in ema.shadow.items()}
    rec["loaded"] = gather_trainable(engine)
    engine_update(engine, state["step"] + 1, rank)
    rec["next"] = gather_trainable(engine)
    return rec


def phase_errors(out: Path, rank: int, world: int) -> dict:
    cfg = make_config()
    engine, _ = build(cfg, world)
    run = out.parent / "train" / "run"            # written by the 2-rank `train` phase
    errors = {}

    def attempt(name, path):
        try:
            checkpoint.load(engine, path)
            errors[name] = None
        except checkpoint.CheckpointError as e:
            errors[name] = str(e)

    attempt("missing", out / "no_such_run")
    attempt("world_size", run)
    damaged = out / "damaged"
    damaged_tag = damaged / "checkpoints" / "step_00000004"
    shutil.copytree(checkpoint.find_latest(run), damaged_tag)
    next(damaged_tag.glob("zero_pp_rank_1_*optim_states.pt")).unlink()
    attempt("damaged", damaged_tag)
    attempt("damaged_run", damaged)
    interrupted = out / "interrupted" / "checkpoints" / "step_00000007"
    shutil.copytree(checkpoint.find_latest(run), interrupted)
    (interrupted / checkpoint.MARKER).unlink()
    attempt("interrupted", interrupted)
    # ZeRO-3 cannot load into the engine that saved: refused before DeepSpeed is asked.
    engine_update(engine, 1, rank)
    checkpoint.save(engine, out / "own", 1, {"step": 1})
    attempt("after_save", out / "own")

    # bf16: the shards carry a bf16_ prefix; a second, fresh engine loads them back exactly.
    cfg16 = make_config()
    cfg16.learner.precision = "bf16"
    first, _ = build(cfg16, world)
    engine_update(first, 1, rank)
    tag_dir = checkpoint.save(first, out / "bf16", 1, {"step": 1})
    saved = gather_trainable(first)
    second, _ = build(cfg16, world)
    state = checkpoint.load(second, tag_dir)
    loaded = gather_trainable(second)
    bf16 = {"files": sorted(checkpoint.read_marker(tag_dir)["files"]), "state": state,
            "dtype": str(next(second.module.parameters()).dtype),
            "equal": saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)}
    return {"errors": errors, "bf16": bf16, "timeout": pg_timeout()}


POLICY_OVERRIDES = [  # a tiny VLA for the pixel task: fast on CPU ranks
    "env.id=PixelReach-v0", "policy.image_size=64", "policy.action_dim=2", "policy.num_action_chunks=4",
    "policy.n_bins=32", "policy.lora_rank=4", "policy.value_head_hidden=32",
    "policy.backbone.text_layers=1", "policy.backbone.text_hidden_size=64",
    "policy.backbone.vision_hidden_size=32", "policy.backbone.vision_layers=1",
    "policy.backbone.intermediate_size=128", "learner.micro_batch_size=4", "learner.lr=1e-2",
    "learner.precision=fp32", "learner.rollout_ema_decay=0.5"]
POLICY_UPDATES = 3


def policy_batch(policy, rank: int):
    """Fixed images, instructions and target action tokens (behaviour cloning), per rank."""
    rng = np.random.default_rng(100 + rank)
    image = rng.integers(0, 256, (MICRO, 64, 64, 3), dtype=np.uint8)
    ids, mask = policy.tokenize(["move the white dot to the red square", "go to the blue square"] * 2)
    bins = rng.integers(0, policy.cfg.n_bins, (MICRO, policy.num_action_tokens))
    return image, ids, mask, bins + policy.action_tokenizer.first_id


def phase_policy(out: Path, rank: int, world: int) -> dict:
    """Like the learner: rank 0 writes policy_init/, every rank loads it into a ZeRO-3 engine; a few
    updates, each followed by gather + EMA; then a checkpoint with the learner's client_state."""
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import VLAPolicy

    cfg = load_config(None, POLICY_OVERRIDES)
    run_dir = out / "run"
    torch.manual_seed(cfg.learner.seed)
    if rank == 0:
        VLAPolicy.build(cfg.policy).save_pretrained(str(run_dir / "policy_init"))
    dist.barrier()
    policy = VLAPolicy.from_pretrained(str(run_dir / "policy_init"))
    ds = ds_engine.build_ds_config(ds_engine.EngineSpec.rl(cfg), world, 1)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0    # shard every tensor
    engine = ds_engine.build_engine(policy, ds_engine.EngineSpec.rl(cfg), 1, ds_config=ds)
    ema = EmaWeights(cfg.learner.rollout_ema_decay) if rank == 0 else None
    gathered = gather_trainable(engine)
    if ema:
        ema.update(gathered)
    image, ids, mask, tokens = policy_batch(policy, rank)
    for _ in range(POLICY_UPDATES):
        o = engine(image, ids, mask, None, replay={"action_tokens": tokens})
        engine.backward(-o.logprobs.mean() + o.values.square().mean())
        engine.step()
        gathered = gather_trainable(engine)
        if ema:
            ema.update(gathered)
    state = {"step": POLICY_UPDATES, "version": POLICY_UPDATES, "env_steps": 0, "rng": checkpoint.rng_state(),
             "config": to_dict(cfg), "ema": ema.state_dict() if ema else None}
    tag_dir = checkpoint.save(engine, run_dir, POLICY_UPDATES, state)
    return {"tag_dir": str(tag_dir), "trained": gathered, "ema": ema.published() if ema else None,
            "partitioned": all(p.numel() == 0 for p in engine.module.parameters())}


UPDATE_T, UPDATE_B, REPORTS = 3, 4, 200


def update_batch(policy, cfg, rank: int):
    """A batch as the ingest builds it, with valid action tokens and truncations to bootstrap."""
    from asyncvla.common.transport.protocol import Segment, SegmentSpec
    from asyncvla.learner.ingest import ColumnBuffer
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this script runs from tests/
    from tests.support.segments import make_segment

    p = cfg.policy
    spec = dataclasses.replace(SegmentSpec.for_policy(cfg, policy.head, policy.action_tokenizer), num_steps=UPDATE_T)
    seg = make_segment(spec, B=UPDATE_B, truncations=2, rng=np.random.default_rng(7 + rank))
    a = dict(seg.arrays)
    ids, mask = policy.tokenize(["move the white dot to the red square"])
    a["instruction"] = np.broadcast_to(ids, a["instruction"].shape).copy()
    a["instruction_mask"] = np.broadcast_to(mask, a["instruction_mask"].shape).copy()
    a["final_instruction"] = np.broadcast_to(ids, a["final_instruction"].shape).copy()
    a["final_instruction_mask"] = np.broadcast_to(mask, a["final_instruction_mask"].shape).copy()
    a["action_tokens"] = a["action_tokens"] % p.n_bins + policy.action_tokenizer.first_id
    a["behavior_logp"] = a["behavior_logp"] * 0.2 - 3.0
    buffer = ColumnBuffer(max_policy_lag=1)
    buffer.add(a, 0)
    return buffer.take(UPDATE_B), Segment(meta=dict(seg.meta), arrays=a)


def hand_targets(ref, batch, cfg, value_affine=(0.0, 1.0)) -> dict:
    """V-trace targets by plain loops over (t, b) on an un-sharded copy of the policy; the head's
    outputs mean value_affine[0] + value_affine[1] * output (a ValueNorm's mean and std)."""
    from asyncvla.common.policy import reduce_logprobs

    a, alg = batch.arrays, cfg.algorithm
    T, B = a["action_tokens"].shape[:2]
    K, D, g = cfg.policy.num_action_chunks, cfg.policy.action_dim, alg.gamma

    def evaluate(image, ids, mask, tokens):
        with torch.no_grad():
            o = ref.evaluate(image[None], ids[None], mask[None], None, {"action_tokens": tokens[None]},
                             alg.logprob_type)
        return o.logprobs[0].double(), value_affine[0] + value_affine[1] * float(o.values[0])

    V = np.zeros((T + 1, B))
    log_rho = np.zeros((T, B))
    for t in range(T + 1):
        for b in range(B):
            tok = a["action_tokens"][min(t, T - 1), b]
            logp, V[t, b] = evaluate(a["image"][t, b], a["instruction"][t, b], a["instruction_mask"][t, b], tok)
            if t < T:
                mu = reduce_logprobs(torch.from_numpy(a["behavior_logp"][t, b][None]), alg.logprob_type, K, D)[0]
                log_rho[t, b] = float((logp - mu.double()).sum())
    r = a["rewards"].astype(np.float64).copy()
    disc = np.full((T, B), g)
    for t in range(T):
        for b in range(B):
            if a["terminated"][t, b] or a["truncated"][t, b]:
                disc[t, b] = 0.0
    for row, (t, b) in enumerate(batch.final_index):            # bootstrap from V(final obs)
        _, v_final = evaluate(batch.finals["final_image"][row], batch.finals["final_instruction"][row],
                              batch.finals["final_instruction_mask"][row], a["action_tokens"][t, b])
        r[t, b] += g * v_final
    vs = np.zeros((T + 1, B))
    adv = np.zeros((T, B))
    for b in range(B):
        vs[T, b] = V[T, b]
        for t in reversed(range(T)):
            rho = np.exp(log_rho[t, b])
            c = alg.vtrace_lambda * min(alg.c_bar, rho)
            delta = min(alg.rho_bar, rho) * (r[t, b] + disc[t, b] * V[t + 1, b] - V[t, b])
            vs[t, b] = V[t, b] + delta + disc[t, b] * c * (vs[t + 1, b] - V[t + 1, b])
        for t in range(T):
            adv[t, b] = min(alg.rho_bar, np.exp(log_rho[t, b])) * (r[t, b] + disc[t, b] * vs[t + 1, b] - V[t, b])
    return {"vs": vs[:T], "advantages": adv, "values": V, "rewards": r, "discounts": disc}


def policy_engine(cfg, out: Path, rank: int):
    """(an un-sharded copy of the policy, the policy in a ZeRO-3 engine): built once by rank 0 into
    out/policy_init and loaded by every rank, as the learner does."""
    from asyncvla.common.policy import VLAPolicy
    torch.manual_seed(cfg.learner.seed)
    if rank == 0:
        VLAPolicy.build(cfg.policy).save_pretrained(str(out / "policy_init"))
    dist.barrier()
    ref = VLAPolicy.from_pretrained(str(out / "policy_init"))
    return ref, ds_engine.build_engine(VLAPolicy.from_pretrained(str(out / "policy_init")), ds_engine.EngineSpec.rl(cfg), 1)


def phase_update(out: Path, rank: int, world: int) -> dict:
    """The learner's update on a ZeRO-3 engine beside an un-sharded copy: compute_targets against
    hand-computed V-trace targets, ppo_epochs' statistics against the loss on the copy's outputs,
    then the per-update report combined over ranks, REPORTS times."""
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import VLAPolicy
    from asyncvla.learner.loss import ppo_loss_from_config
    from asyncvla.learner.metrics import Metrics
    from asyncvla.learner.update import compute_targets, ppo_epochs
    from asyncvla.learner.value_norm import ValueNorm

    overrides = POLICY_OVERRIDES + ["learner.micro_batch_size=64", "algorithm.update_epochs=1",
                                    "algorithm.num_minibatches=1", "algorithm.gamma=0.9",
                                    "algorithm.vtrace_lambda=0.8", "algorithm.rho_bar=1.5"]
    cfg = load_config(None, overrides)
    ref, engine = policy_engine(cfg, out, rank)
    batch, segment = update_batch(ref, cfg, rank)
    device = torch.device("cpu")

    targets = compute_targets(engine, batch, cfg, device)
    hand = hand_targets(ref, batch, cfg)
    # With value normalisation: outputs read as mean + std * output, the statistics updated with
    # every rank's targets, value targets and old values returned in the new statistics' units.
    norm = ValueNorm(0.5)
    norm.update(torch.tensor([-1.0, 5.0]))               # mean 2, std 3
    normed = compute_targets(engine, batch, cfg, device, norm)
    hand_normed = hand_targets(ref, batch, cfg, value_affine=(2.0, 3.0))
    # The other estimators on the same batch and weights: GAE from the critic; GRPO with the actors'
    # advantages, and no forward pass on the truncation finals (rows: the policy's inputs per call).
    gae = compute_targets(engine, batch, load_config(None, [*overrides, "algorithm.adv_type=gae",
                                                           "algorithm.gae_lambda=0.7"]), device)
    rows = []
    hook = engine.module.register_forward_pre_hook(lambda m, args, kw: rows.append(len(kw["image"])), with_kwargs=True)
    compute_targets(engine, batch, cfg, device)
    rows_vtrace, rows[:] = sum(rows), []
    rng = np.random.default_rng(rank)
    grpo_batch = dataclasses.replace(batch, arrays={
        **batch.arrays, "advantage": rng.normal(size=batch.arrays["rewards"].shape).astype(np.float32),
        "advantage_mask": (rng.random(batch.arrays["rewards"].shape) < 0.7).astype(np.uint8)})
    grpo = compute_targets(engine, grpo_batch, load_config(None, [*overrides, "algorithm.adv_type=grpo"]), device)
    hook.remove()
    stats = ppo_epochs(engine, batch, targets, cfg, device, seed=3)
    a = batch.arrays
    T, B = a["action_tokens"].shape[:2]
    flat = lambda x: x.reshape(T * B, *x.shape[2:])   # noqa: E731
    with torch.no_grad():
        o = ref.evaluate(flat(a["image"][:T]), flat(a["instruction"][:T]), flat(a["instruction_mask"][:T]),
                         None, {"action_tokens": flat(a["action_tokens"])}, cfg.algorithm.logprob_type)
    adv = flat(targets["advantages"])
    _, ref_stats = ppo_loss_from_config(
        cfg.algorithm, new_logp=o.logprobs.float(), behavior_logp=flat(targets["behavior_logp"]),
        advantages=adv, values=o.values.float(), old_values=flat(targets["old_values"]),
        value_targets=flat(targets["vs"]), entropy=o.entropy.float(), rhos=flat(targets["rhos"]),
        advantage_stats=(adv.mean(), adv.std(unbiased=False)))

    metrics = Metrics(None, REPORTS, False)
    sizes, reports = [], []
    for i in range(REPORTS):
        for _ in range(rank + 1):                     # rank r receives r+1 segments per update
            metrics.add_segment(segment, lag=rank + 1)
        reports.append(metrics.report(i + 1, {"train/actor/policy_loss": float(rank), "train/actor/ratio_max": rank + 2.0},
                                      {"stale": rank, "future_version": 0, "invalid": 1}, samples=10,
                                      time_up=(rank == 1 and i == REPORTS - 1)))
        sizes.append(len(metrics.actors) + sum(1 for _ in metrics.counts) + len(vars(metrics)))
    return {"targets": {k: targets[k].numpy() for k in ("vs", "advantages", "old_values")}, "hand": hand,
            "normed": {k: normed[k].numpy() for k in ("vs", "advantages", "old_values")},
            "hand_normed": hand_normed, "norm": (norm.mean, norm.std),
            "gae": {k: gae[k].numpy() for k in ("vs", "advantages", "old_values", "mask")},
            "grpo": {**{k: grpo[k].numpy() for k in ("vs", "advantages", "old_values", "mask")},
                     "sent": grpo_batch.arrays["advantage"], "sent_mask": grpo_batch.arrays["advantage_mask"]},
            "rows": {"vtrace": rows_vtrace, "grpo": sum(rows), "finals": len(batch.final_index)},
            "stats": stats, "ref_stats": ref_stats, "reports": [reports[0], reports[-1]], "sizes": sizes,
            "segment_episodes": len(segment.arrays["ep_return"]),
            "segment_success": float(segment.arrays["ep_success"].sum()),
            "segment_env_steps": int(segment.meta["env_steps"])}


def phase_poison(out: Path, rank: int, world: int) -> dict:
    """A flow head's update on 2 ZeRO-3 ranks where rank 1's batch holds one column whose chain is
    finite but huge (real values x 2e30: validation bypassed), with a FiniteGuard that stops at the
    first non-finite step. update() must find that column, leave it out, and take finite steps."""
    from asyncvla.common.config import load_config
    from asyncvla.common.policy import VLAPolicy
    from asyncvla.common.transport.protocol import SegmentSpec
    from asyncvla.learner.ingest import ColumnBuffer
    from asyncvla.learner.publish import trainable_finite
    from asyncvla.learner.update import FiniteGuard, update
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this script runs from tests/
    from tests.support.segments import make_segment

    cfg = load_config(None, POLICY_OVERRIDES + ["policy.action_head=flow", "policy.is_lora=false",
                                                "learner.micro_batch_size=8", "algorithm.update_epochs=2",
                                                "algorithm.num_minibatches=2"])
    policy, engine = policy_engine(cfg, out, rank)
    p = cfg.policy
    spec = dataclasses.replace(SegmentSpec.for_policy(cfg, policy.head, policy.action_tokenizer), num_steps=UPDATE_T)
    buffer = ColumnBuffer(max_policy_lag=1)
    for actor in ("honest", "poisoner"):        # two segments of 2 columns each
        a = dict(make_segment(spec, B=2, truncations=1, rng=np.random.default_rng(3 + rank)).arrays)
        ids, mask = policy.tokenize(["move the white dot to the red square"])
        for k in ("instruction", "final_instruction"):
            a[k] = np.broadcast_to(ids, a[k].shape).copy()
        for k in ("instruction_mask", "final_instruction_mask"):
            a[k] = np.broadcast_to(mask, a[k].shape).copy()
        if actor == "poisoner" and rank == 1:
            a["flow_chain"] = a["flow_chain"].copy()
            a["flow_chain"][:, 1] *= np.float32(2e30)
        buffer.add(a, 0, actor)
    batch = buffer.take(4)
    guard = FiniteGuard(max_in_a_row=1)
    stats = [update(engine, batch, cfg, torch.device("cpu"), step=i, guard=guard) for i in range(2)]
    return {"poisoned": [s["poisoned_columns"] for s in stats], "poisoned_by": [s["poisoned_by"] for s in stats],
            "skipped": guard.skipped, "weights_finite": trainable_finite(engine),
            "loss_finite": all(np.isfinite(s["policy_loss"]) and np.isfinite(s["value_loss"]) for s in stats),
            "chain_max": float(np.abs(batch.arrays["flow_chain"]).max())}


FAULT_STAGES = (2, 3)     # ZeRO-2: rank 0's states file carries every rank's RNG; ZeRO-3: each its own


def seed_per_rank(rank: int) -> None:
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)


@contextlib.contextmanager
def disk_full(active: bool):
    """While active, torch.save into a file on this rank writes part of it, then fails as a full
    disk does (into memory, as pickling a tensor for a collective does, it works)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return real(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    torch.save = save if active else real
    try:
        yield
    finally:
        torch.save = real


def phase_faults(out: Path, rank: int, world: int) -> dict:
    rec = {}
    for stage in FAULT_STAGES:
        cfg = make_config()
        cfg.learner.zero_stage = stage
        engine, _ = build(cfg, world)
        seed_per_rank(rank)                      # every rank its own streams, as in a real run
        run_dir, saves, tags = out / f"zero{stage}", {}, {}
        for update, failing_rank in ((1, None), (2, 1), (3, 0), (4, None)):
            engine_update(engine, update, rank)
            with disk_full(rank == failing_rank):
                saves[update] = checkpoint.save(engine, run_dir, update, {"step": update})
            tags[update] = sorted(d.name for d in (run_dir / "checkpoints").iterdir() if d.is_dir())
        rec[stage] = {"saves": saves, "tags": tags, "draws": rng_draws(), "trained": gather_trainable(engine)}
    tiny = os.environ.get("ASYNCVLA_TINY_DISK")
    if tiny:
        rec["tiny"] = tiny_disk(Path(tiny), rank, world)
    return rec


def tiny_disk(run_dir: Path, rank: int, world: int) -> dict:
    """Saves on a small filesystem, filled so that two checkpoints fit and a third does not."""
    cfg = make_config()
    engine, _ = build(cfg, world)
    root = run_dir / "checkpoints"
    rec = {"saves": {}, "tags": {}}

    def save(update, state):
        engine_update(engine, update, rank)
        rec["saves"][update] = checkpoint.save(engine, run_dir, update, state, keep_last=2)
        rec["tags"][update] = sorted(d.name for d in root.iterdir() if d.is_dir())

    save(1, {"step": 1})
    if rank == 0:                              # leave room for 1.6 checkpoints
        tag = root / checkpoint.tag_name(1)
        size = sum(f.stat().st_blocks * 512 for f in tag.iterdir()) + 4096
        free = shutil.disk_usage(root).free
        (run_dir / "ballast").write_bytes(b"\0" * max(free - int(1.6 * size), 0))
        rec["tag_size"], rec["free_before"] = size, shutil.disk_usage(root).free
    dist.barrier()
    save(2, {"step": 2, "ballast": torch.ones(2 ** 18)})     # 1 MiB more than there is room for
    save(3, {"step": 3})
    rec["free_after_3"] = shutil.disk_usage(root).free
    save(4, {"step": 4})                                       # fits only once step 1 is gone
    return rec


def phase_faults_resume(out: Path, rank: int, world: int) -> dict:
    rec = {}
    for stage in FAULT_STAGES:
        cfg = make_config()
        cfg.learner.zero_stage = stage
        engine, _ = build(cfg, world)
        seed_per_rank(99)                        # whatever the streams were, load restores them
        found = checkpoint.find_latest(out.parent / "faults" / f"zero{stage}")
        state = checkpoint.load(engine, found)
        rec[stage] = {"found": str(found), "state": state, "draws": rng_draws(),
                      "loaded": gather_trainable(engine)}
    return rec


def pg_timeout():
    """The default process group's collective time-out (a torch internal: None if it moved)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return None


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2]) / sys.argv[1]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ds_engine.init_distributed(make_config())
    rank, world = dist.get_rank(), dist.get_world_size()
    t_init = time.perf_counter() - t0
    rec = {"train": phase_train, "resume": phase_resume, "errors": phase_errors,
           "policy": phase_policy, "update": phase_update, "poison": phase_poison, "faults": phase_faults,
           "faults_resume": phase_faults_resume}[phase](out, rank, world)
    rec.update(world=world, init_s=t_init, phase_s=time.perf_counter() - t0)
    torch.save(rec, out / f"rank{rank}.pt")
    ds_engine.close_distributed()
    # Results are saved and the process group is down. Skip interpreter teardown: a library
    # thread still alive there can abort the process ("terminate called without an active
    # exception") on a loaded machine, which would turn a finished phase into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
