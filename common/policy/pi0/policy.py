"""A LeRobot π0 / π0.5 policy loaded into asyncvla: acts as LeRobot 0.4.3's PI0Policy / PI05Policy
with their processors do.

    vla = PI0.load(DIR)
    ids, mask = vla.tokenize(["push the cube to the goal"] * B, state)      # (needs the tokenizer)
    chunk = vla.act_chunk({"observation.images.base_0_rgb": images}, state, ids, mask, noise)

What LeRobot's processors and policy do to an observation, done here without LeRobot:
    instruction   π0: the task with a newline appended; π0.5: "Task: {task}, State: {s};\\nAction: "
                  with the task's "_" and newlines made spaces and s the normalised, zero-padded
                  state in 256 bins over [-1, 1] ("12 255 0 ..."); tokenised by PaliGemma's tokenizer
                  (<bos> first), padded on the right to tokenizer_max_length, cut there
    images        [B, 3, H, W] in [0, 1] (uint8 [B, H, W, 3]: / 255), normalised if VISUAL is, resized
                  to image_resolution keeping the aspect (bilinear, clamped to [-1, 1]) and padded on
                  both sides with -1, then mapped to [-1, 1] by x * 2 - 1 (so LeRobot's padding ends
                  up at -3: it pads before mapping); a camera the observation lacks is an image of -1,
                  masked out, after the cameras it has (LeRobot's order)
    state         π0: normalised with the directory's statistics, zero-padded to max_state_dim, into
                  the state token; π0.5: only in the prompt
    actions       the chunk's first action_dim entries, un-normalised
`noise` [B, chunk_size, max_action_dim] (LeRobot's `noise` argument) fixes the draw; without it a
standard normal draw is taken.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..lerobot_dir import WEIGHTS, LeRobotDirError, LeRobotFlowVLA, normalize
from .network import build_net
from .spec import read_policy_dir


class PI0(LeRobotFlowVLA):

    @classmethod
    def load(cls, path, device="cpu", dtype: torch.dtype = torch.float32) -> "PI0":
        """Read a LeRobot π0 / π0.5 directory (spec.py), build the network and load its tensors; the
        tokenizer too where it is found (else `tokenize` refuses and acting takes given tokens)."""
        d = read_policy_dir(path)
        net = build_net(d.spec, str(Path(path) / "config.json"))
        net.load_weights(d.weights, str(Path(path) / WEIGHTS))
        d.weights = {}                           # (the network holds them now)
        tokenizer = None
        if d.tokenizer_dir is not None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(d.tokenizer_dir)
        return cls(d, net.to(device=device, dtype=dtype).eval(), tokenizer)

    # ------------------------------------------------------------------------------ inputs
    def prompts(self, tasks: list[str], state=None) -> list[str]:
        """The text LeRobot's preprocessor tokenises for each task."""
        if not self.spec.pi05:
            return [t if t.endswith("\n") else t + "\n" for t in tasks]
        if state is None:
            raise ValueError("π0.5 writes the state into its prompt: tokenize(tasks, state)")
        bins = np.digitize(self.normalized_state(state).cpu().numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        return [f"Task: {t.strip().replace('_', ' ').replace(chr(10), ' ')}, State: {' '.join(map(str, b))};\nAction: "
                for t, b in zip(tasks, bins)]

    def tokenize(self, tasks: list[str], state=None) -> tuple[np.ndarray, np.ndarray]:
        """ids int64 [B, L], mask bool [B, L] as LeRobot's tokenizer step makes them."""
        if self.tokenizer is None:
            name = self.dir.tokenizer_step.get("tokenizer_name") or "google/paligemma-3b-pt-224"
            raise LeRobotDirError(f"{self.dir.path}: the tokenizer {name!r} is neither a directory nor in the local "
                                  "Hugging Face cache (no download here); pass token ids to act_chunk instead")
        step = self.dir.tokenizer_step
        out = self.tokenizer(self.prompts(tasks, state), max_length=step.get("max_length", self.spec.tokenizer_max_length),
                             truncation=step.get("truncation", True), padding=step.get("padding", "max_length"),
                             padding_side=step.get("padding_side", "right"), return_tensors="np")
        return out["input_ids"].astype(np.int64), out["attention_mask"].astype(bool)

    def images(self, frames: dict) -> tuple[list, list]:
        """{image key: [B, 3, H, W] float in [0, 1], or [B, H, W, 3] uint8} -> the pixels per camera
        and which rows have it, in LeRobot's order (present cameras, then missing ones)."""
        present = [k for k in self.spec.image_keys if k in frames]
        if not present:
            raise ValueError(f"the observation has none of this policy's cameras {list(self.spec.image_keys)}")
        pixels, masks = [], []
        for key in present:
            x = torch.as_tensor(frames[key])
            if x.dtype == torch.uint8:
                x = x.permute(0, 3, 1, 2).float() / 255.0
            x = x.to(self.device, torch.float32)
            if self.spec.mode("VISUAL") != "IDENTITY":
                x = normalize(x, self.dir.stats.get(key, {}), self.spec.mode("VISUAL"))
            if tuple(x.shape[2:]) != self.spec.image_resolution:
                x = resize_with_pad(x, *self.spec.image_resolution)
            pixels.append(x * 2.0 - 1.0)
            masks.append(torch.ones(x.shape[0], dtype=torch.bool, device=self.device))
        for _ in range(len(self.spec.image_keys) - len(present)):
            pixels.append(torch.ones_like(pixels[-1]) * -1)
            masks.append(torch.zeros_like(masks[-1]))
        return pixels, masks


def resize_with_pad(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, C, H, W] scaled to fit height x width with its aspect kept (bilinear, clamped to [-1, 1]),
    padded with -1 evenly on both sides (the odd pixel after): LeRobot's resize_with_pad_torch."""
    h, w = x.shape[2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return F.pad(x, (left, width - new_w - left, top, height - new_h - top), value=-1.0)
