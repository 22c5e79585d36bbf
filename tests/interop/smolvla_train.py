"""Train a tiny SmolVLA with LeRobot 0.4.3's own classes on a LeRobot dataset that asyncvla wrote
(`asyncvla collect --format lerobot`), and save it as LeRobot saves a policy. This is the "user's own
trained VLA" that the learning runs of docs/models.md load into asyncvla. Runs in the interop
environment only (`make interop-env`), offline:

    .venv-interop/bin/python tests/interop/smolvla_train.py DATASET OUT_DIR [--steps N] [--seed S] ...

DATASET: a LeRobot v3.0 dataset with one camera. OUT_DIR/ then holds vlm/ (the tiny SmolVLM of
tests/golden/smolvla/vlm, copied: LeRobot loads its random weights as the backbone) and policy/
(config.json, model.safetensors and the processor files, as `SmolVLAPolicy.save_pretrained` and the
processors' `save_pretrained` write them; `vlm_model_name` is the absolute path of OUT_DIR/vlm).

The loop is lerobot-train's, cut to what a CPU run needs: LeRobotDataset with the action chunk as
delta timestamps, SmolVLA's pre-processor built from the dataset's statistics (tokenizer, MEAN_STD
normalisation), `policy.forward(batch)` for the flow-matching loss, and SmolVLA's own optimizer and
scheduler presets (AdamW; warm-up and cosine decay, which LeRobot scales to a run this short).

A dataset without observation.state (the pixel task's) is trained with a zero state of one
dimension: LeRobot's SmolVLA always reads a state, and a zero state padded to max_state_dim is what
asyncvla feeds a policy without one. The saved config then lists no state, so that the directory
matches an env without one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

VLM = Path(__file__).resolve().parents[1] / "golden" / "smolvla" / "vlm"
STATE = "observation.state"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (SmolVLA's optimizer_lr)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--num-steps", type=int, default=4, help="denoising steps (SmolVLA's num_steps)")
    ap.add_argument("--num-vlm-layers", type=int, default=2)
    ap.add_argument("--max-state-dim", type=int, default=32)
    ap.add_argument("--vlm-patch-size", type=int, default=16,
                    help="16: the fixtures' tiny SmolVLM (4 image tokens); 8: the same built with patches of 8 "
                         "(16 image tokens), random weights seeded as the fixtures' (smolvla_side.build_vlm)")
    ap.add_argument("--vlm-position-init", choices=["random", "sincos"], default="random",
                    help="the vision tower's patch positions: random (the fixtures') or asyncvla's fixed 2-D "
                         "sine-cosine pattern, which a random-init tower reads at once")
    ap.add_argument("--train-vlm", action="store_true",
                    help="train the VLM too (train_expert_only=false, freeze_vision_encoder=false)")
    args = ap.parse_args()

    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    vlm_dir, pdir = out / "vlm", out / "policy"
    if args.vlm_patch_size == 16 and args.vlm_position_init == "random":
        shutil.copytree(VLM, vlm_dir)
    else:
        from smolvla_side import build_vlm          # (this script's folder is on sys.path)
        build_vlm(vlm_dir, patch_size=args.vlm_patch_size, position_init=args.vlm_position_init)

    probe = LeRobotDataset("local/demos", root=args.dataset)
    fps, features = probe.meta.fps, probe.meta.features
    cameras = [k for k, f in features.items() if f["dtype"] in ("video", "image")]
    if len(cameras) != 1:
        raise SystemExit(f"{args.dataset}: {len(cameras)} cameras {cameras}; this script trains on one")
    has_state = STATE in features
    h, w, c = features[cameras[0]]["shape"]
    inputs = {cameras[0]: PolicyFeature(type=FeatureType.VISUAL, shape=(c, h, w)),
              STATE: PolicyFeature(type=FeatureType.STATE, shape=(features[STATE]["shape"][0] if has_state else 1,))}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=tuple(features["action"]["shape"]))}
    norm = {"VISUAL": NormalizationMode.IDENTITY, "ACTION": NormalizationMode.MEAN_STD,
            "STATE": NormalizationMode.MEAN_STD if has_state else NormalizationMode.IDENTITY}
    config = SmolVLAConfig(
        vlm_model_name=str(vlm_dir), input_features=inputs, output_features=outputs, normalization_mapping=norm,
        device="cpu", load_vlm_weights=True, chunk_size=args.chunk_size, n_action_steps=args.chunk_size,
        num_steps=args.num_steps, num_vlm_layers=args.num_vlm_layers, resize_imgs_with_padding=(h, w),
        max_state_dim=args.max_state_dim, max_action_dim=max(16, outputs["action"].shape[0]),
        tokenizer_max_length=48, train_expert_only=not args.train_vlm, freeze_vision_encoder=not args.train_vlm,
        optimizer_lr=args.lr, push_to_hub=False)

    dataset = LeRobotDataset("local/demos", root=args.dataset,
                             delta_timestamps={"action": [i / fps for i in range(args.chunk_size)]})
    stats = {k: {s: torch.as_tensor(v) for s, v in d.items()} for k, d in dataset.meta.stats.items()}
    policy = SmolVLAPolicy(config).train()
    pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    params = [p for p in policy.get_optim_params() if p.requires_grad]
    opt = config.get_optimizer_preset().build(params)                   # AdamW, SmolVLA's settings
    sched = config.get_scheduler_preset().build(opt, args.steps)        # warm-up + cosine decay, scaled to the steps
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         num_workers=0, generator=torch.Generator().manual_seed(args.seed))
    print(f"{len(dataset)} frames, {dataset.num_episodes} episodes, camera {cameras[0]} {h}x{w}, "
          f"state {'yes' if has_state else 'none (zeros)'}; "
          f"{sum(p.numel() for p in params):,} trainable of {sum(p.numel() for p in policy.parameters()):,}",
          flush=True)

    step, start, window = 0, time.time(), []
    while step < args.steps:
        for batch in loader:
            if not has_state:
                batch[STATE] = torch.zeros(batch["action"].shape[0], 1)
            loss, _ = policy.forward(pre(batch))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.optimizer_grad_clip_norm)   # (lerobot-train's clip)
            opt.step()
            sched.step()
            step += 1
            window.append(loss.item())
            if step % 100 == 0 or step == args.steps:
                print(f"step {step}/{args.steps} loss {sum(window) / len(window):.4f} "
                      f"({time.time() - start:.0f} s)", flush=True)
                window = []
            if step == args.steps:
                break

    policy.eval()
    policy.save_pretrained(pdir)
    pre.save_pretrained(pdir)
    post.save_pretrained(pdir)
    if not has_state:
        cj = json.loads((pdir / "config.json").read_text())
        cj["input_features"].pop(STATE)
        (pdir / "config.json").write_text(json.dumps(cj, indent=4))
    print(f"wrote {pdir}")


if __name__ == "__main__":
    main()
