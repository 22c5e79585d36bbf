"""Learned action queries after the prompt (OpenVLA-OFT): one pass of the language model reads the
prompt and N = K*D query embeddings, and the hidden state at query i stands for action entry i.
The parallel head reads action-token logits off those states, the Gaussian head a mean.

Attention: the prompt stays causal (its hidden states, and so the value, are those of the
autoregressive head) and every query attends to the whole prompt and to every other query, in
both directions, as OFT does. The backbone is a causal LM, so the mask is handed over as a ready
4-D additive mask, which transformers passes to the attention unchanged (eager and SDPA; flash
attention takes no 4-D mask). The same mask builder gives a prefix LM (PaliGemma) its prompt mask.
"""

from __future__ import annotations

import torch
from torch import nn


class ActionQueries(nn.Module):
    """N learned input embeddings [N, H], one per action entry."""

    def __init__(self, num_tokens: int, hidden_size: int, std: float):
        super().__init__()
        # The std of the backbone's own embedding init: queries start on the scale of token inputs.
        self.weight = nn.Parameter(torch.randn(num_tokens, hidden_size) * std)

    def forward(self, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, N, H] in `dtype`. A copy, not a view: ZeRO-3 frees the gathered weight right after."""
        return self.weight.to(dtype).unsqueeze(0).repeat(batch, 1, 1)


def query_pass(policy, prompt, queries: ActionQueries) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + N action queries -> the hidden states at the queries [B, N, H] and the value [B]
    (read at the last prompt token, which does not see the queries)."""
    embeds, attn, pos, image = prompt
    (b, p, _), n = embeds.shape, policy.num_action_tokens
    embeds = torch.cat([embeds, queries(b, embeds.dtype)], 1)
    pos = torch.cat([pos, pos[..., -1:] + torch.arange(1, n + 1, device=pos.device)], -1)
    attn = query_attention_mask(attn, n, embeds.dtype, bidirectional_prompt=policy.family.prefix_bidirectional)
    hidden = policy.decode(embeds, attn, pos, cache=None, use_cache=False).last_hidden_state
    return hidden[:, p:], policy.value_head(hidden[:, p - 1], image)


def query_attention_mask(prompt_mask: torch.Tensor, num_queries: int, dtype: torch.dtype,
                         bidirectional_prompt: bool = False, causal_queries: bool = False) -> torch.Tensor:
    """Prompt padding mask [B, P] (1 = token) -> additive mask [B, 1, P+N, P+N] (0 = attend, dtype's
    min = blocked): prompt rows see earlier non-padding prompt tokens (every one with
    `bidirectional_prompt`: a prefix LM such as PaliGemma), query rows see every non-padding prompt
    token and every query (only earlier ones with `causal_queries`: action tokens fed back)."""
    b, p = prompt_mask.shape
    i = torch.arange(p + num_queries, device=prompt_mask.device)
    causal = i[None, :] <= i[:, None]
    among_queries = (i[:, None] >= p) & (i[None, :] >= p) & (not causal_queries)
    if bidirectional_prompt:
        causal = causal | ((i[:, None] < p) & (i[None, :] < p))
    keys = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(b, num_queries, dtype=torch.bool)], 1)
    allowed = (causal | among_queries)[None] & keys[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=prompt_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
