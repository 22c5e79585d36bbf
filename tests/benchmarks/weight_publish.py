"""Weight publishing: gather + EMA + send + actor-side load, absolute and as a share of a learner step.

Why: the learner publishes after every update; if that costs a visible share of an update, the
async design loses what it gains. Two payloads, each over the real code paths, with the learner
side in its own process and the actor side in this one:

  tiny   the benchmark policy's LoRA + value head in a 1-rank DeepSpeed ZeRO-3 engine (1 thread,
         like the async-vs-sync learner): `gather_trainable` out of ZeRO-3, `EmaWeights.update`,
         `WeightServer.publish` -> `WeightSubscriber.wait_newer` in the actor process (send = from
         the publish call to the arrays in the actor's hands), `VLAPolicy.load_trainable_state_dict`.
         Its learner step (the workload's `update`, median) is the denominator of the share.
  large  a SYNTHETIC dict with the shapes of a 7B-class VLA's LoRA at rank 32 (OpenVLA-like:
         Llama-2-7B, DINOv2-L and SigLIP-so400m, every linear layer, plus the projector and a value
         head: ~111 M fp32 parameters, 974 tensors). Gather = `gather_trainable` on a plain module
         (the copy only; no ZeRO-3 partitioning), then the same EMA, send and load (the load is
         VLAPolicy.load_trainable_state_dict applied to a module holding those shapes). There is no
         7B learner step on this machine: the table gives the step length for which it is 1 %.

Goal (issue #9): the whole cycle < 1 % of a learner step.

    python -m tests.benchmarks.weight_publish [--quick] [--out bench_results/weight_publish.json]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from functools import partial

import numpy as np
import torch
from torch import nn

from tests.benchmarks import workload
from tests.benchmarks.report import Figure, at_most, main

PHASES = ("gather_s", "ema_s", "send_s", "load_s")
# Untimed versions first: the connection warms up, and the first publishes of a large payload
# fault in fresh pages for every copy (4-10x slower) until the allocator reuses freed memory.
WARMUP_VERSIONS = 3
TIMEOUT_S = 300
KEY = b"weight publish benchmark"      # the learner side signs with it: the actor side holds the token


def run(quick: bool = False) -> dict:
    versions = {"tiny": 5 if quick else 10, "large": 2 if quick else 4}
    return {kind: measure(kind, n, step_updates=2 if quick else 3) for kind, n in versions.items()}


def measure(kind: str, versions: int, step_updates: int) -> dict:
    """Publish `versions` versions from a learner process; time each phase (medians)."""
    from asyncvla.common.config import TransportConfig
    from asyncvla.common.policy import VLAPolicy
    from asyncvla.common.transport import WeightSubscriber

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_learner_side, args=(kind, versions, step_updates, child))
    proc.start()
    try:
        if kind == "tiny":
            actor_policy = VLAPolicy.build(workload.config().policy)
            load = actor_policy.load_trainable_state_dict
        else:
            load = partial(VLAPolicy.load_trainable_state_dict, LoraPayload(lora_7b_shapes()))
        info = _recv(parent)
        from asyncvla.common.transport.auth import actor_token
        sub = WeightSubscriber(info["endpoint"], TransportConfig(), actor_id="bench",
                               token=actor_token(KEY, "bench", "", "bench"))
        rows = []
        for v in range(versions + WARMUP_VERSIONS):    # steady state: see WARMUP_VERSIONS
            parent.send(v)
            got = sub.wait_newer(v - 1, timeout=120)
            received_at = time.monotonic()
            if got is None or got[0] != v:
                raise RuntimeError(f"version {v} did not arrive (got {got and got[0]})")
            t0 = time.perf_counter()
            load({k: torch.from_numpy(a) for k, a in got[1].items()})
            load_s = time.perf_counter() - t0
            timings = _recv(parent)
            if v >= WARMUP_VERSIONS:
                rows.append({"gather_s": timings["gather_s"], "ema_s": timings["ema_s"],
                             "publish_call_s": timings["publish_call_s"],
                             "send_s": received_at - timings["sent_at"], "load_s": load_s})
            del got
        parent.send(None)
        sub.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    total = sum(med[k] for k in PHASES)
    return {"parameters": info["parameters"], "tensors": info["tensors"], "bytes": info["bytes"],
            "versions": versions, "median": med, "total_s": total,
            "learner_blocking_s": med["gather_s"] + med["ema_s"] + med["publish_call_s"],
            "learner_step_s": info["step_s"],
            "share_of_step": total / info["step_s"] if info["step_s"] else None, "per_version": rows}


def _learner_side(kind: str, versions: int, step_updates: int, conn) -> None:
    """The learner's half: payload, (tiny) learner step time, then gather + EMA + publish per version."""
    try:
        from asyncvla.common.config import TransportConfig
        from asyncvla.common.transport import WeightServer
        from asyncvla.learner.publish import EmaWeights, gather_trainable

        torch.set_num_threads(workload.LEARNER_THREADS)
        cfg = workload.config()
        step_s = None
        if kind == "tiny":
            from tests.benchmarks.learner_scaling import build_learner, timed_updates
            model, batch, device = build_learner(cfg, 1, 0)
            step_s = float(np.median(timed_updates(model, batch, cfg, device, step_updates)))
        else:
            model = LoraPayload(lora_7b_shapes())
        server = WeightServer(TransportConfig(), endpoint="tcp://127.0.0.1:*", auth_key=KEY)
        ema = EmaWeights(cfg.learner.rollout_ema_decay)
        first = gather_trainable(model)
        conn.send({"endpoint": server.endpoint, "step_s": step_s, "tensors": len(first),
                   "parameters": sum(t.numel() for t in first.values()),
                   "bytes": sum(t.numel() * 4 for t in first.values())})
        ema.update(first)                                    # the first update only copies
        del first
        while (v := conn.recv()) is not None:
            t0 = time.perf_counter()
            tensors = gather_trainable(model)
            t1 = time.perf_counter()
            published = ema.update(tensors)
            arrays = {k: t.numpy() for k, t in published.items()}
            t2 = time.perf_counter()
            sent_at = time.monotonic()                       # one clock for both processes
            server.publish(v, arrays)
            conn.send({"gather_s": t1 - t0, "ema_s": t2 - t1, "publish_call_s": time.perf_counter() - t2,
                       "sent_at": sent_at})
        server.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    sys.stdout.flush()
    os._exit(0)                 # as tests/ds_worker.py: no interpreter teardown once results are out


def _recv(conn):
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"the learner side sent nothing in {TIMEOUT_S} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"learner side failed:\n{msg['error']}")
    return msg


# ------------------------------------------------------------------------- the large payload
def lora_7b_shapes(rank: int = 32) -> dict[str, tuple]:
    """LoRA A [r, in] and B [out, r] of every linear layer of an OpenVLA-like 7B VLA, + value head."""
    linears = []
    for i in range(32):         # Llama-2-7B: hidden 4096, MLP 11008
        linears += [(f"llm{i}_{m}", 4096, 4096) for m in ("q", "k", "v", "o")]
        linears += [(f"llm{i}_gate", 4096, 11008), (f"llm{i}_up", 4096, 11008), (f"llm{i}_down", 11008, 4096)]
    for i in range(24):         # DINOv2 ViT-L/14: hidden 1024, MLP 4096, fused qkv
        linears += [(f"dino{i}_qkv", 1024, 3072), (f"dino{i}_proj", 1024, 1024),
                    (f"dino{i}_fc1", 1024, 4096), (f"dino{i}_fc2", 4096, 1024)]
    for i in range(27):         # SigLIP so400m/14: hidden 1152, MLP 4304
        linears += [(f"siglip{i}_{m}", 1152, 1152) for m in ("q", "k", "v", "o")]
        linears += [(f"siglip{i}_fc1", 1152, 4304), (f"siglip{i}_fc2", 4304, 1152)]
    linears += [("proj_fc1", 2176, 8704), ("proj_fc2", 8704, 4096), ("proj_fc3", 4096, 4096)]
    shapes = {}
    for name, fan_in, fan_out in linears:
        shapes[f"{name}_lora_A"] = (rank, fan_in)
        shapes[f"{name}_lora_B"] = (fan_out, rank)
    shapes.update({"value_head_0_weight": (256, 4096), "value_head_0_bias": (256,),
                   "value_head_2_weight": (1, 256), "value_head_2_bias": (1,)})
    return shapes


class LoraPayload(nn.Module):
    """Trainable tensors of the given shapes, loadable with VLAPolicy.load_trainable_state_dict."""

    def __init__(self, shapes: dict[str, tuple]):
        super().__init__()
        self.p = nn.ParameterDict({k: nn.Parameter(torch.full(s, 0.01)) for k, s in shapes.items()})

    def _is_trainable(self, name: str) -> bool:
        return True


def figures(r: dict) -> list[Figure]:
    out = []
    for kind, label in (("tiny", "tiny VLA (ZeRO-3)"), ("large", "7B LoRA r32 SYNTHETIC")):
        m = r[kind]
        med = m["median"]
        phases = ", ".join(f"{k[:-2]} {1e3 * med[k]:.1f}" for k in PHASES) + " ms"
        size = f"{m['parameters'] / 1e6:.1f} M params"
        out.append(Figure("weight publish", f"{label}: gather+EMA+send+load", m["total_s"], "ms",
                          note=f"{size}; {phases}"))
        if m["share_of_step"] is not None:
            out.append(Figure("weight publish", f"{label}: share of a learner step", m["share_of_step"], "%",
                              "< 1 %", at_most(m["share_of_step"], 0.01),
                              note=f"step {m['learner_step_s']:.2f} s (1 rank x {workload.LEARNER_THREADS} "
                                   f"thread); learner blocked {1e3 * m['learner_blocking_s']:.1f} ms"))
        else:
            out.append(Figure("weight publish", f"{label}: step for which it is 1 %", 100 * m["total_s"], "s",
                              "< 1 %", None, note=f"no 7B learner step here to compare with; learner blocked "
                                                  f"{1e3 * m['learner_blocking_s']:.0f} ms"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
