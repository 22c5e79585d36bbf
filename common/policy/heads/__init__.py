"""Action heads: how a policy turns the VLM's prompt into a chunk of K x D actions, and how it
scores that chunk again. Each head is one module of this package, registered in HEADS under its
`policy.action_head` name; nothing outside this package asks which head a policy has.

A head (ActionHead) owns:
    modules()              its parameters, {name: nn.Module}, which the policy sets on itself
                           under those names (saved with its other heads in heads.safetensors)
    replay_fields()        what a segment carries per policy step so that the learner can score
                           the action again, {name: protocol.Field}: the segment schema takes them
    act(...)      -> Acted     actions, the replay of them, their log-probs and the value
    evaluate(...) -> Scored    the log-probs and entropies of a replay, and the value
    sft_loss(...) -> SFTLoss   supervised loss on demo actions, and the value
Log-probs and entropies are per action entry, [B, N] with N = K*D (token heads: one per token;
continuous heads: one per dimension and step); the policy sums them to the log-prob level asked
for (logprobs.reduce_logprobs). Rollout, protocol, learner and SFT pass the replay dict through.

`prompt` is the policy's prompt pass input: (embeddings [B, P, H], attention mask [B, P],
positions, image uint8 [B, H, W, 3]); heads reach the VLM through the policy (`decode`, `embed`,
`action_logits`, `prompt_mask`) and its value head (`value_head`). Parameters are only ever used
through a submodule's call: under ZeRO-3 that call is what gathers them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Acted(NamedTuple):
    actions: torch.Tensor              # [B, K, D] in the env's units (the policy's action range)
    replay: dict                       # name -> tensor [B, ...]: what scores the action again
    logprobs: torch.Tensor             # [B, N] behaviour log-probs per action entry
    values: torch.Tensor               # [B]


class Scored(NamedTuple):
    logprobs: torch.Tensor             # [B, N] (with grad)
    entropy: torch.Tensor              # [B, N]
    values: torch.Tensor               # [B]


class SFTLoss(NamedTuple):
    loss: torch.Tensor                 # [B] per-sample supervised loss (with grad)
    values: torch.Tensor               # [B]
    stats: dict                        # name -> tensor [B] (e.g. token_accuracy), averaged by SFT


class ActionHead:
    """One way of producing and scoring actions; see the package docstring. `cfg` is the policy's
    PolicyConfig. Subclasses set `name` and implement the methods below."""
    name = ""
    # Whether behaviour log-probs are densities (continuous actions: may be > 0) rather than
    # probabilities of discrete tokens (<= 0): the segment schema bounds them accordingly.
    densities = False
    # Whether sft_loss draws random numbers (SFT then hands it a seeded generator).
    sft_draws = False

    def __init__(self, cfg):
        self.cfg = cfg

    def modules(self, hidden_size: int, init_std: float) -> dict[str, nn.Module]:
        """The head's own parameters, as modules the policy registers under these names."""
        return {}

    def replay_fields(self) -> dict:
        raise NotImplementedError

    def check_replay(self, arrays: dict) -> str | None:
        """What is wrong with a received segment's replay arrays beyond their declared dtypes,
        shapes and ranges (None: nothing); the receiver refuses the segment with it."""
        return None

    def act(self, policy, prompt, temperature: float, greedy: bool, generator) -> Acted:
        raise NotImplementedError

    def evaluate(self, policy, prompt, replay: dict, temperature: float) -> Scored:
        raise NotImplementedError

    def sft_loss(self, policy, prompt, actions: torch.Tensor, generator) -> SFTLoss:
        raise NotImplementedError

    def freezes_backbone(self) -> bool:
        """True when only the heads train (the VLM frozen whatever policy.is_lora says)."""
        return False

    def adapt(self, policy, cfg) -> None:
        """A saved policy loaded for a run whose config sets this head's free choices otherwise
        (e.g. a flow head's noise method): change what those choices own."""


HEADS: dict[str, type] = {}


def register(head: type) -> type:
    """Class decorator: make `head` available as policy.action_head=head.name."""
    HEADS[head.name] = head
    return head


def make_head(cfg) -> ActionHead:
    """The head policy.action_head names (ValueError naming the allowed ones otherwise)."""
    if cfg.action_head not in HEADS:
        raise ValueError(f"policy.action_head={cfg.action_head!r} is not allowed; choose one of {list(HEADS)}")
    return HEADS[cfg.action_head](cfg)


# The heads, each registering itself (after the base above, which they import).
from . import autoregressive, flow, gaussian, parallel  # noqa: E402,F401
