"""What the two token heads share: actions as tokens over n_bins bins per dimension (OpenVLA style:
the last n_bins ids of the VLM's vocabulary), their log-probs and entropies at a temperature,
and SFT as the cross-entropy of the demo's tokens.

A token head draws bins and makes one pass that gives every token's logits and the value; act
and evaluate get their numbers from that same pass (`token_logprobs`), so the learner's log-probs
of the behaviour tokens reproduce the actor's exactly for the same weights and inputs.
"""

from __future__ import annotations

import torch

from asyncvla.common.transport.protocol import Field

from . import Acted, ActionHead, Scored, SFTLoss
from ..logprobs import action_log_softmax, token_logprobs

REPLAY = {"action_tokens": Field("int64", ("N",), "step", "action_ids")}


class TokenHead(ActionHead):
    """A head whose actions are action tokens. Subclasses give `logits` (the pass that scores N
    given bins: logits [B, N, n_bins], values [B]) and `draw` (bins [B, N] and, when drawing made
    it, that pass's (logits, values))."""

    def replay_fields(self) -> dict:
        return REPLAY

    def logits(self, policy, prompt, bins: torch.Tensor):
        raise NotImplementedError

    def draw(self, policy, prompt, temperature: float, greedy: bool, generator):
        raise NotImplementedError

    def act(self, policy, prompt, temperature, greedy, generator) -> Acted:
        bins, made = self.draw(policy, prompt, temperature, greedy, generator)
        logits, values = made if made is not None else self.logits(policy, prompt, bins)
        logp, _ = token_logprobs(logits, bins, temperature)
        tok = policy.action_tokenizer
        actions = tok.from_bins(bins.cpu()).reshape(-1, self.cfg.num_action_chunks, self.cfg.action_dim)
        return Acted(actions, {"action_tokens": bins + tok.first_id}, logp, values)

    def evaluate(self, policy, prompt, replay, temperature) -> Scored:
        bins = _bins(policy, replay["action_tokens"], prompt[0].shape[0])
        logits, values = self.logits(policy, prompt, bins)
        logp, entropy = token_logprobs(logits, bins, temperature)
        return Scored(logp, entropy, values)

    def sft_loss(self, policy, prompt, actions, generator) -> SFTLoss:
        """Cross-entropy of the demo's tokens (the binned actions), at temperature 1."""
        bins = policy.action_tokenizer.to_bins(actions.reshape(actions.shape[0], -1)).to(policy.device)
        logits, values = self.logits(policy, prompt, bins)
        logp, _ = token_logprobs(logits, bins, 1.0)
        accuracy = (logits.detach().argmax(-1) == bins).float().mean(1)
        return SFTLoss(-logp.mean(1), values, {"token_accuracy": accuracy})


def choose(logits: torch.Tensor, temperature: float, greedy: bool, generator) -> torch.Tensor:
    """Bins [...] from action logits [..., n_bins]: sampled from softmax(logits / T), or the argmax."""
    if greedy:
        return logits.argmax(-1)
    probs = action_log_softmax(logits, temperature).exp()
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return drawn.view(probs.shape[:-1]).to(logits.device)


def _bins(policy, action_tokens, batch: int) -> torch.Tensor:
    """Action-token ids [B, N] checked (shape, integer, among the action ids) -> bins [B, N]."""
    tokens = torch.as_tensor(action_tokens)
    n = policy.num_action_tokens
    if tokens.ndim != 2 or tuple(tokens.shape) != (batch, n) or tokens.is_floating_point():
        raise ValueError(f"action_tokens must be integer [B={batch}, N={n}] "
                         f"(K={policy.cfg.num_action_chunks} x D={policy.cfg.action_dim}); got "
                         f"{str(tokens.dtype).replace('torch.', '')} {list(tokens.shape)}")
    first, vocab = policy.action_tokenizer.first_id, policy.action_tokenizer.vocab_size
    if int(tokens.min()) < first or int(tokens.max()) >= vocab:
        raise ValueError(f"action_tokens must be action-token ids in [{first}, {vocab}); got values in "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    return tokens.to(policy.device, torch.long) - first
