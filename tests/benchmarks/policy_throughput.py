"""Throughput of the tiny VLA policy on CPU (default config: K=4, D=7, 64 px, LoRA rank 32), with
each action head: autoregressive (N = K*D passes of the language model per act, KV cache, then
one scoring pass), parallel (one pass over the prompt and N action queries) and flow (one pass
over the prompt, then the action expert once per denoising step: 4, the default, and 10).

act():      policy actions (chunks of K env steps) per second at batch 1, 8 and 32 (sampling, no grad)
evaluate(): samples per second of forward + backward (the learner's inner step) at batch 8 and 32
Also the size of what weight publishing ships: trainable_state_dict() of the tiny model, and the
same figure computed for a 7B-class backbone (Llama-2-7B text dims) at the configured LoRA rank.

    python -m tests.benchmarks.policy_throughput [--quick] [--out bench_results/policy_throughput.json]

`--config C --device cuda` measures the same on the policy section of config C instead, random-init
(e.g. configs/pi0_gpu.yaml: pi0's shape, ~3.3 B parameters, bf16 on a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import numpy as np
import torch

from asyncvla.common.config import PolicyConfig, load_config
from asyncvla.common.policy import VLAPolicy
from asyncvla.common.policy.backbone import write_tiny_backbone
from tests.benchmarks.report import Figure, at_least, at_most, best_of, main

ACT_BATCHES = (1, 8, 32)
EVAL_BATCHES = (8, 32)


def head_configs(base: PolicyConfig) -> dict[str, PolicyConfig]:
    """The policy of `base` with each action head (the flow head at 4 and 10 denoising steps)."""
    flow = lambda n: dataclasses.replace(base, action_head="flow",                      # noqa: E731
                                         flow=dataclasses.replace(base.flow, num_steps=n))
    return {"autoregressive": dataclasses.replace(base, action_head="autoregressive"),
            "parallel": dataclasses.replace(base, action_head="parallel"),
            "flow N=4": flow(4), "flow N=10": flow(10)}


def add_arguments(parser) -> list[str]:
    parser.add_argument("--config", default=None,
                        help="measure this config's policy section (random-init) instead of the tiny default")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (bf16 under precision: auto)")
    return ["config", "device"]


def run(quick: bool = False, config: str | None = None, device: str = "cpu") -> dict:
    cfg = load_config(config).policy if config else PolicyConfig()
    repeats = 2 if quick else 5
    results = {"device": device, "config": config or "tiny default", "torch_threads": torch.get_num_threads(),
               "quick": quick, "num_action_chunks": cfg.num_action_chunks, "action_dim": cfg.action_dim,
               "build_s": {}, "act": {}, "evaluate": {}, "trainable_state_dict": {}, "total_parameters": {}}
    policies = {}
    with tempfile.TemporaryDirectory() as backbone_dir:
        if not cfg.pretrained_path:
            # Initialised and written once, then loaded by each head: a 3 B backbone takes minutes to init.
            t0 = time.perf_counter()
            write_tiny_backbone(backbone_dir, cfg.backbone, cfg.image_size, cfg.n_bins, seed=cfg.init_seed)
            results["build_s"]["backbone (random init, written)"] = round(time.perf_counter() - t0, 3)
            cfg = dataclasses.replace(cfg, pretrained_path=backbone_dir)
        for head, head_cfg in head_configs(cfg).items():
            t0 = time.perf_counter()
            policies[head] = VLAPolicy.build(head_cfg, device=device)
            results["build_s"][head] = round(time.perf_counter() - t0, 3)
    results["act"] = act_throughput(policies, repeats)
    for head, policy in policies.items():
        results["evaluate"][head] = evaluate_throughput(policy, repeats)
        sd = policy.trainable_state_dict()
        results["trainable_state_dict"][head] = {
            "tensors": len(sd), "parameters": sum(v.numel() for v in sd.values()),
            "bytes": sum(v.numel() * v.element_size() for v in sd.values())}
        results["total_parameters"][head] = sum(p.numel() for p in policy.parameters())
    results["trainable_state_dict"]["llama2_7b_text_q_k_v_o"] = lora_publish_size(
        hidden=4096, layers=32, rank=cfg.lora_rank, value_hidden=cfg.value_head_hidden)
    if torch.device(device).type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        results["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return results


def _synced(fn):
    """fn, then wait for the GPU's queued work: a CUDA call returns before its kernels finish."""
    def call():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return call


def act_throughput(policies: dict, repeats: int) -> dict:
    """act() of each head at ACT_BATCHES, best of `repeats` calls. The heads take turns call by call,
    so a slow spell of the machine falls on both and their ratio is not an artefact of when each ran."""
    act = {head: {} for head in policies}
    for policy in policies.values():
        policy.eval()
    for b in ACT_BATCHES:
        calls = {}
        for head, policy in policies.items():
            image, ids, mask = _batch(policy, b)
            gen = torch.Generator().manual_seed(0)
            calls[head] = _synced(lambda p=policy, x=(image, ids, mask), g=gen: p.act(*x, generator=g))
            calls[head]()                                          # warm-up
        best = {head: float("inf") for head in policies}
        for _ in range(repeats):
            for head, call in calls.items():
                best[head] = min(best[head], best_of(1, call))
        for head, sec in best.items():
            k = policies[head].cfg.num_action_chunks
            act[head][f"batch_{b}"] = {"seconds_per_call": round(sec, 4), "actions_per_s": round(b / sec, 2),
                                       "env_steps_per_s": round(b * k / sec, 2)}
    return act


def evaluate_throughput(policy, repeats: int) -> dict:
    """evaluate() forward + backward at EVAL_BATCHES, best of `repeats`."""
    evaluate = {}
    policy.train()
    for b in EVAL_BATCHES:
        image, ids, mask = _batch(policy, b)
        acted = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(1))
        chains = {"flow_chain": acted.flow_chain, "flow_stochastic": acted.flow_stochastic} \
            if acted.flow_chain is not None else {}

        def step():
            out = policy.evaluate(image, ids, mask, None, acted.replay, **chains)
            (-(out.logprobs.sum()) + out.values.square().sum()).backward()
            policy.zero_grad(set_to_none=True)
        step = _synced(step)
        step()  # warm-up
        sec = best_of(repeats, step)
        evaluate[f"batch_{b}"] = {"seconds_per_step": round(sec, 4), "samples_per_s": round(b / sec, 2)}
    return evaluate


def lora_publish_size(hidden: int, layers: int, rank: int, value_hidden: int, modules: int = 4) -> dict:
    """Tensors / parameters / bytes of LoRA on `modules` square projections per layer + the value head."""
    lora_params = layers * modules * 2 * rank * hidden          # A [r, h] and B [h, r]
    head_params = hidden * value_hidden + value_hidden + value_hidden + 1
    params = lora_params + head_params
    return {"tensors": layers * modules * 2 + 4, "parameters": params,
            "bytes_fp32": params * 4, "bytes_bf16": params * 2}


def _batch(policy, b: int):
    rng = np.random.default_rng(b)
    image = rng.integers(0, 256, (b, policy.cfg.image_size, policy.cfg.image_size, 3), dtype=np.uint8)
    texts = ["push the cube to the goal region", "pick up the red cube", "lift the peg"]
    ids, mask = policy.tokenize([texts[i % len(texts)] for i in range(b)])
    return image, ids, mask


def figures(results: dict) -> list[Figure]:
    tiny = results.get("config", "tiny default") == "tiny default"
    bench = "policy (tiny VLA)" if tiny else \
        f"policy ({os.path.basename(results['config'])}, {results.get('gpu') or results['device']})"
    out = []
    for head, rows in results["act"].items():
        for b, r in rows.items():
            out.append(Figure(bench, f"act() {head} {b} actions/s", r["actions_per_s"], "/s",
                              note=f"{r['env_steps_per_s']:.1f} env steps/s, "
                                   f"{r['seconds_per_call'] * 1e3:.1f} ms/call"))
    act = results["act"]
    if {"autoregressive", "parallel"} <= set(act):
        for b in act["parallel"]:
            ratio = act["parallel"][b]["actions_per_s"] / act["autoregressive"][b]["actions_per_s"]
            goal = tiny and b == "batch_8"   # the figure: 7 x 4-token chunks at batch 8
            out.append(Figure(bench, f"act() parallel / autoregressive, {b}", ratio, "x",
                              ">= 5x" if goal else "", at_least(ratio, 5.0) if goal else None))
    if {"flow N=4", "parallel"} <= set(act):
        for b in act["parallel"]:
            cost = act["flow N=4"][b]["seconds_per_call"] / act["parallel"][b]["seconds_per_call"]
            goal = tiny and b == "batch_8"   # the flow head's budget: at most 2x the parallel head
            out.append(Figure(bench, f"act() time flow N=4 / parallel, {b}", cost, "x",
                              "<= 2x" if goal else "", at_most(cost, 2.0) if goal else None))
    for head, rows in results["evaluate"].items():
        for b, r in rows.items():
            out.append(Figure(bench, f"evaluate() {head} fwd+bwd {b} samples/s", r["samples_per_s"],
                              "/s", note=f"{r['seconds_per_step'] * 1e3:.1f} ms/step"))
    for name, r in results["trainable_state_dict"].items():
        out.append(Figure(bench, f"published weights, {name}", r.get("bytes", r.get("bytes_fp32")),
                          "MB", note=f"{r['tensors']} tensors, {r['parameters']:,} parameters, fp32"))
    for head, n in results["total_parameters"].items():
        out.append(Figure(bench, f"parameters, {head}", n / 1e6, "M"))
    if "peak_gpu_memory_gb" in results:
        out.append(Figure(bench, "peak GPU memory (all heads loaded)", results["peak_gpu_memory_gb"], "GB"))
    return out


if __name__ == "__main__":
    main(sys.modules[__name__])
