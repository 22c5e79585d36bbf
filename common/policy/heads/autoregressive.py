"""The autoregressive token head (OpenVLA): the N = K*D action tokens one by one, each fed back.

Acting samples them with the KV cache (N passes of one token each, no grad); scoring makes one
teacher-forced pass over the prompt and the tokens. The reported log-probs come from that
teacher-forced pass even when acting, so actor and learner agree to the last bit on the same
inputs (the cached logits differ from it by rounding only).
"""

from __future__ import annotations

import torch

from . import register
from .queries import query_attention_mask
from .tokens import TokenHead, choose


@register
class AutoregressiveHead(TokenHead):
    name = "autoregressive"

    def draw(self, policy, prompt, temperature, greedy, generator):
        """Decoding with the KV cache -> bins [B, N] (and no pass to reuse: it was N small ones)."""
        embeds, attn, pos, _ = prompt
        out = policy.decode(embeds, policy.prompt_mask(attn, embeds.dtype), pos, cache=None, use_cache=True)
        bins = []
        for i in range(policy.num_action_tokens):
            logits = policy.action_logits(out.last_hidden_state[:, -1])  # [B, n_bins]
            bins.append(choose(logits, temperature, greedy, generator))
            if i + 1 < policy.num_action_tokens:
                attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], 1)
                pos = pos[..., -1:] + 1
                embeds = policy.embed(bins[-1][:, None] + policy.action_tokenizer.first_id)
                out = policy.decode(embeds, attn, pos, cache=out.past_key_values, use_cache=True)
        return torch.stack(bins, 1), None

    def logits(self, policy, prompt, bins):
        """Prompt + action tokens -> action logits [B, N, n_bins], values [B] (teacher-forced)."""
        embeds, attn, pos, image = prompt
        p, n = embeds.shape[1], policy.num_action_tokens
        # The last action token predicts nothing we score, so it is not fed.
        embeds = torch.cat([embeds, policy.embed(bins[:, :-1] + policy.action_tokenizer.first_id)], 1)
        if policy.family.prefix_bidirectional:
            attn = query_attention_mask(attn, n - 1, embeds.dtype, bidirectional_prompt=True, causal_queries=True)
        else:
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], n - 1)], 1)
        pos = torch.cat([pos, pos[..., -1:] + torch.arange(1, n, device=pos.device)], -1)
        hidden = policy.decode(embeds, attn, pos, cache=None, use_cache=False).last_hidden_state
        return policy.action_logits(hidden[:, p - 1:]), policy.value_head(hidden[:, p - 1], image)
