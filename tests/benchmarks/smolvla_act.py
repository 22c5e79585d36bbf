"""act() of SmolVLA at its published shape (lerobot/smolvla_base: 450 M parameters) on this CPU.

asyncvla's SmolVLANet built from common/policy/smolvla/released.py (SmolVLM2-500M cut to 16 layers,
an expert 0.75 as wide, chunk 50, 10 denoising steps) with random weights, acting at batch 1 on
one 512 x 512 camera (smolvla_base's image size after resize-with-padding: 64 image tokens), a
12-token instruction and the state: `SmolVLANet.sample`, timed in its two parts, the prefix pass
(SigLIP, the connector and the VLM's 16 layers over 77 tokens, keeping their keys and values) and
the 10 denoising steps (the expert over the 50 action tokens, reading that cache). Median of 5
runs after one warm-up, or of fewer once they have taken 30 s (a machine busy with other work:
the table's "others" cores say how busy), and the fastest run, the least disturbed; all the
machine's cores as torch threads. In two weight layouts:
    float32     every weight float32
    bfloat16    LeRobot's: the VLM and the expert in bfloat16 except the expert's cross-attention
                key and value projections, the state, action and time projections float32
Each layout runs in a fresh process (spawned), so its peak RSS (the process's high-water mark:
Python, torch and transformers, the weights and the activations) is its own; the weights are
made on the meta device and then given storage, so no transient copy counts. ~1.5 minutes on 2
quiet cores (a few more where other work slows it); --quick: float32 only, 2 runs, ~40 s.

    python -m tests.benchmarks.smolvla_act [--quick] [--out bench_results/smolvla_act.json]
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import resource
import statistics
import sys
import time

from tests.benchmarks.report import Figure, main

BATCH, INSTRUCTION_TOKENS = 1, 12
BUDGET_S = 30.0          # of timed runs per layout, after the warm-up: fewer runs on a busy machine
LAYOUTS = ("float32", "bfloat16")


def run(quick: bool = False) -> dict:
    from tests.benchmarks import smolvla_act          # (by its module name: the spawned process imports it)
    repeats = 2 if quick else 5
    layouts = LAYOUTS[:1] if quick else LAYOUTS
    results = {"shape": "lerobot/smolvla_base (common/policy/smolvla/released.py)", "batch": BATCH,
               "cameras": 1, "instruction_tokens": INSTRUCTION_TOKENS, "max_runs_after_warm_up": repeats,
               "run_budget_s": BUDGET_S, "layouts": {}}
    for layout in layouts:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results["layouts"][layout] = pool.submit(smolvla_act.measure, layout, repeats, BUDGET_S).result()
    return results


def measure(layout: str, repeats: int, budget_s: float) -> dict:
    """In a fresh process: build the net in `layout`, time `repeats` act() calls after a warm-up
    (at least one; no more once they have taken `budget_s`)."""
    import torch

    from asyncvla.common.policy.smolvla import released
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rss_start = _rss()
    t0 = time.perf_counter()
    net = materialise(released.smolvla_base_net("meta"), layout)
    build_s, rss_weights = time.perf_counter() - t0, _rss()
    spec, g = net.spec, torch.Generator().manual_seed(1)
    w, h = spec.resize_imgs_with_padding
    vocab = net.vlm_with_expert.vlm.config.text_config.vocab_size
    images = [torch.rand(BATCH, 3, h, w, generator=g) * 2 - 1]
    present = [torch.ones(BATCH, dtype=torch.bool)]
    ids = torch.randint(0, vocab, (BATCH, INSTRUCTION_TOKENS), generator=g)
    id_mask = torch.ones(BATCH, INSTRUCTION_TOKENS, dtype=torch.bool)
    state = torch.randn(BATCH, spec.max_state_dim, generator=g)
    noise = torch.randn(BATCH, spec.chunk_size, spec.max_action_dim, generator=g)

    @torch.no_grad()
    def act() -> tuple[float, float, torch.Tensor, int]:
        """SmolVLANet.sample, its two parts timed; the chunk and the prefix's length."""
        t = time.perf_counter()
        cache, pad, _ = net.prefix(images, present, ids, id_mask, state)
        t_prefix = time.perf_counter()
        dt, x = -1.0 / spec.num_steps, noise
        for i in range(spec.num_steps):
            tau = torch.full((BATCH,), 1.0 + i * dt, dtype=torch.float32)
            x = x + dt * net.velocity(x, tau, cache, pad)
        return t_prefix - t, time.perf_counter() - t_prefix, x, pad.shape[1]

    chunk = net.sample(images, present, ids, id_mask, state, noise)          # warm-up
    assert chunk.shape == (BATCH, spec.chunk_size, spec.max_action_dim) and bool(torch.isfinite(chunk).all())
    timed, end = [], time.perf_counter() + budget_s
    while len(timed) < repeats and (not timed or time.perf_counter() < end):
        timed.append(act())
    runs, prefix_tokens = [r[:2] for r in timed], timed[0][3]
    differs = max(float((r[2] - chunk).abs().max()) for r in timed)
    assert differs <= 1e-3, f"the timed steps are not SmolVLANet.sample's: max difference {differs}"
    prefix_s = statistics.median(r[0] for r in runs)
    denoise_s = statistics.median(r[1] for r in runs)
    act_s = statistics.median(r[0] + r[1] for r in runs)
    fastest = min(runs, key=sum)
    return {"layout": layout, "torch_threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in net.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
            "prefix_tokens": prefix_tokens,
            "build_s": round(build_s, 2), "act_s": round(act_s, 4), "prefix_s": round(prefix_s, 4),
            "denoise_s": round(denoise_s, 4), "denoise_step_s": round(denoise_s / spec.num_steps, 4),
            "fastest_act_s": round(sum(fastest), 4), "fastest_prefix_s": round(fastest[0], 4),
            "fastest_denoise_s": round(fastest[1], 4),
            "runs": [[round(a, 4), round(b, 4)] for a, b in runs], "max_difference_from_sample": differs,
            "rss_start_bytes": rss_start, "rss_weights_bytes": rss_weights, "peak_rss_bytes": _peak_rss()}


def materialise(net, layout: str):
    """The meta-device net given CPU storage in `layout` and random weights: matrices N(0, 0.02),
    norm scales 1, biases 0 (the rotary buffers transformers keeps are unused: asyncvla computes
    its own angles)."""
    import torch
    if layout == "bfloat16":
        vwe = net.vlm_with_expert.to(torch.bfloat16)
        for i, layer in enumerate(vwe.lm_expert.layers):
            if not vwe.is_self_attention(i):
                layer.self_attn.k_proj.float()
                layer.self_attn.v_proj.float()
    net.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
        for b in net.buffers():
            b.zero_()
    return net.eval()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024          # (kB on Linux)


def figures(results: dict) -> list[Figure]:
    bench, out = "SmolVLA act() (smolvla_base, CPU)", []
    for layout, r in results["layouts"].items():
        what = f"{layout}, batch {results['batch']}, 1 camera 512 px, chunk 50, 10 steps"
        out += [Figure(bench, f"act() {what}", r["act_s"], "s",
                       note=f"median of {len(r['runs'])} after a warm-up, {r['torch_threads']} threads; "
                            f"fastest {r['fastest_act_s']:.2f} s"),
                Figure(bench, f"  prefix pass ({layout})", r["prefix_s"], "s",
                       note=f"SigLIP + 16 VLM layers over {r['prefix_tokens']} tokens; fastest run's "
                            f"{r['fastest_prefix_s']:.2f} s"),
                Figure(bench, f"  10 denoising steps ({layout})", r["denoise_s"], "s",
                       note=f"{r['denoise_step_s'] * 1e3:.0f} ms per step; fastest run's "
                            f"{r['fastest_denoise_s']:.2f} s"),
                Figure(bench, f"  peak RSS ({layout})", r["peak_rss_bytes"], "MB",
                       note=f"weights {r['weight_bytes'] / 2**20:.0f} MB; RSS {r['rss_start_bytes'] / 2**20:.0f} MB "
                            "after imports")]
    first = next(iter(results["layouts"].values()))
    out.append(Figure(bench, "parameters", first["parameters"] / 1e6, "M",
                      note=f"{first['parameters']:,}, LeRobot's count too (tests/test_smolvla_released.py)"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
