"""Prompt layout and instruction tokenization.

A policy step's sequence is
    [<s>] <fake_token_around_image> <global-img> <image> x n <fake_token_around_image>   (fixed)
    instruction tokens, left-padded to L with an attention mask                          (L)
    [one proprio-state token]                                                            (0 or 1)
    N = K*D action tokens (autoregressive head) or N learned action queries (parallel head)
(SmolVLM's single-image block; each backbone family places its own markers around the image:
families/; a marker the tokenizer lacks is left out). Padding sits between the
image block and the instruction, so every query position still sees the image and position ids
come from the mask (cumsum - 1): a short instruction is placed exactly like a long one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptLayout:
    before_image: tuple
    image_token_id: int
    image_seq_len: int
    after_image: tuple
    max_instruction_tokens: int
    pad_id: int
    state_token: bool

    @property
    def image_start(self) -> int:
        return len(self.before_image)

    @property
    def fixed_ids(self) -> list:
        return [*self.before_image, *[self.image_token_id] * self.image_seq_len, *self.after_image]

    @property
    def length(self) -> int:
        """Prompt length P: the hidden state at P-1 predicts the first action token and feeds V(x)."""
        return len(self.fixed_ids) + self.max_instruction_tokens + int(self.state_token)

    def to_dict(self) -> dict:
        return {"before_image": list(self.before_image), "image_token_id": self.image_token_id,
                "image_seq_len": self.image_seq_len, "after_image": list(self.after_image),
                "max_instruction_tokens": self.max_instruction_tokens, "pad_id": self.pad_id,
                "state_token": self.state_token}


def make_layout(tokenizer, image_token_id: int, image_seq_len: int, max_instruction_tokens: int,
                state_token: bool, markers: tuple[list, list]) -> PromptLayout:
    """`markers`: the backbone family's token ids before and after the image tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    before, after = markers
    return PromptLayout(before_image=tuple(before), image_token_id=int(image_token_id),
                        image_seq_len=int(image_seq_len), after_image=tuple(after),
                        max_instruction_tokens=max_instruction_tokens, pad_id=int(pad), state_token=state_token)


def tokenize_instructions(tokenizer, texts, max_tokens: int, pad_id: int):
    """list[str] -> (ids int64 [B, L], mask uint8 [B, L]), left-padded; too long raises ValueError."""
    if isinstance(texts, str):
        raise TypeError("tokenize expects a list of instructions, got a single str; wrap it in a list")
    rows = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    ids = np.full((len(rows), max_tokens), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), max_tokens), dtype=np.uint8)
    for i, (text, row) in enumerate(zip(texts, rows)):
        if len(row) > max_tokens:
            raise ValueError(f"instruction {text!r} has {len(row)} tokens; the limit is "
                             f"policy.max_instruction_tokens={max_tokens}")
        if row:
            ids[i, max_tokens - len(row):] = row
            mask[i, max_tokens - len(row):] = 1
    return ids, mask
