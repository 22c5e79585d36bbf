"""A LeRobot SmolVLA policy loaded into asyncvla: acts exactly as LeRobot's SmolVLAPolicy does.

    vla = SmolVLA.load(DIR)
    ids, mask = vla.tokenize(["push the cube to the goal"] * B)
    chunk = vla.act_chunk({"observation.images.cam": images}, state, ids, mask, noise)   # env units

What LeRobot's processors and policy do to an observation, done here without LeRobot:
    instruction   the task with a newline appended, tokenised by the VLM's tokenizer (padded on the
                  right, cut at tokenizer_max_length)
    images        [0, 1] -> resized to fit resize_imgs_with_padding (bilinear, aspect kept), padded on
                  the left and top with black, then mapped to [-1, 1]; uint8 images are / 255 first
    state         normalised with the directory's statistics, zero-padded to max_state_dim
    actions       the chunk's first action_dim entries, un-normalised
`noise` [B, chunk_size, max_action_dim] (LeRobot's `noise` argument) makes the two comparable
exactly; without it a standard normal draw is taken.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..lerobot_dir import LeRobotFlowVLA
from .checkpoint import LeRobotDirError, read_policy_dir
from .network import SmolVLANet


class SmolVLA(LeRobotFlowVLA):

    @classmethod
    def load(cls, path, device="cpu", dtype: torch.dtype = torch.float32) -> "SmolVLA":
        """Read a LeRobot SmolVLA directory (checkpoint.py) and build the network with its tensors."""
        from transformers import AutoConfig, AutoTokenizer
        d = read_policy_dir(path)
        vlm_config = AutoConfig.from_pretrained(d.vlm_dir)
        tokenizer = AutoTokenizer.from_pretrained(d.vlm_dir)
        with torch.random.fork_rng(devices=[]):      # (the init the loaded tensors replace draws numbers)
            net = SmolVLANet(vlm_config, d.spec, getattr(tokenizer, "fake_image_token_id", None),
                             getattr(tokenizer, "global_image_token_id", None))
        net.load_weights(d.weights, str(Path(path) / "model.safetensors"))
        return cls(d, net.to(device=device, dtype=dtype).eval(), tokenizer)

    def tokenize(self, tasks: list[str], max_length: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """ids int64 [B, L], mask bool [B, L]: each task + "\\n", padded on the right to the longest
        (LeRobot's default) or, with `max_length`, to tokenizer_max_length (the same actions: padding
        is masked out)."""
        texts = [t if t.endswith("\n") else t + "\n" for t in tasks]
        out = self.tokenizer(texts, max_length=self.spec.tokenizer_max_length, truncation=True,
                             padding="max_length" if max_length else self.spec.pad_language_to,
                             padding_side="right", return_tensors="np")
        return out["input_ids"].astype(np.int64), out["attention_mask"].astype(bool)

    def images(self, frames: dict) -> tuple[list, list]:
        """{image key: [B, 3, H, W] float in [0, 1], or [B, H, W, 3] uint8} -> SmolVLA's pixels per
        camera in the config's order, and which rows have the camera (all)."""
        pixels, present = [], []
        for key in self.spec.image_keys:
            if key not in frames:
                raise ValueError(f"the observation lacks camera {key!r} (this policy reads {list(self.spec.image_keys)})")
            x = torch.as_tensor(frames[key])
            if x.dtype == torch.uint8:
                x = x.permute(0, 3, 1, 2).float() / 255.0
            x = x.to(self.device, torch.float32)
            if self.spec.resize_imgs_with_padding is not None:
                x = resize_with_pad(x, *self.spec.resize_imgs_with_padding)
            pixels.append(x * 2.0 - 1.0)
            present.append(torch.ones(x.shape[0], dtype=torch.bool, device=self.device))
        return pixels, present


def resize_with_pad(x: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """[B, C, H, W] scaled to fit width x height with its aspect kept (bilinear), the rest filled
    with 0 on the left and top, as LeRobot's SmolVLA prepares images."""
    if x.ndim != 4:
        raise LeRobotDirError(f"images must be [B, C, H, W]; got {list(x.shape)}")
    h, w = x.shape[2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False)
    return F.pad(x, (max(0, width - new_w), 0, max(0, height - new_h), 0), value=0.0)
