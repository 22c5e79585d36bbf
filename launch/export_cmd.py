"""`asyncvla export CHECKPOINT --out DIR`: a trained policy as a standalone directory.

CHECKPOINT is a run directory (its latest complete checkpoint), its checkpoints/ folder or one
checkpoint folder, written by any number of learner ranks. The ZeRO shards are consolidated with
DeepSpeed's zero_to_fp32 and DIR is written with VLAPolicy.save_pretrained, so it loads with
`VLAPolicy.from_pretrained(DIR)` and needs no DeepSpeed:

    DIR/backbone/            Hugging Face checkpoint of the VLM (LoRA merged in) + tokenizer
    DIR/adapter/             with --keep-lora: the peft adapter (the backbone is then the base)
    DIR/heads.safetensors    value head (+ state encoder)
    DIR/policy.json          action-token spec, prompt layout, image spec, policy settings
    DIR/config.yaml          the run's resolved config;  DIR/export.json: source, step, weights
    DIR/policy_state_dict.pt with --state-dict: {"policy": policy.json, "state_dict": tensors}

With --format lerobot a SmolVLA policy (policy.pretrained_path a LeRobot directory) is written as
LeRobot writes it instead: config.json, model.safetensors, the processor files, and DIR/vlm (the
VLM's config and tokenizer, named by absolute path), which LeRobot's SmolVLAPolicy loads.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint's policy to a standalone directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="CHECKPOINT", help="run dir, its checkpoints/ dir or a checkpoint dir")
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) output directory")
    p.add_argument("--keep-lora", action="store_true",
                   help="keep LoRA as a peft adapter beside the base backbone instead of merging it")
    p.add_argument("--weights", choices=["trained", "ema"], default="trained",
                   help="the learner's weights (default) or the published EMA weights the actors ran")
    p.add_argument("--state-dict", action="store_true",
                   help="also write policy_state_dict.pt, one torch file for deployment scripts")
    p.add_argument("--format", choices=["asyncvla", "lerobot"], default="asyncvla",
                   help="lerobot: a SmolVLA policy as LeRobot's SmolVLAPolicy.from_pretrained loads it (its "
                        "processors and VLM beside it), for a policy loaded from a LeRobot directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from asyncvla.common.config import ConfigError
    from asyncvla.learner.export import export_policy

    t0 = time.perf_counter()
    try:
        info = export_policy(args.path, args.out, keep_lora=args.keep_lora, weights=args.weights,
                             state_dict=args.state_dict, fmt=args.format)
    except (ConfigError, OSError, ValueError) as e:
        print(f"asyncvla export: {e}", file=sys.stderr)
        return 2
    total = sum(info["files"].values())
    print(f"exported {info['path']} (step {info['step']}, {info['weights']} weights, LoRA {info['lora']}) "
          f"to {args.out}: {len(info['files'])} files, {total / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
