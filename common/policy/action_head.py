"""The parallel action head (OpenVLA-OFT): all N = K*D action tokens from one forward pass.

N learned action-query embeddings are placed after the prompt; the hidden state at query i gives
the logits of action token i. No sampled token is fed back, so a policy step costs one pass of the
language model instead of N, and the learner's teacher-forced pass is that same pass (the action
tokens never enter the input).

Attention: the prompt stays causal (its hidden states, and so the value, are those of the
autoregressive head) and every query attends to the whole prompt and to every other query, in
both directions, as OFT does. The backbone is a causal LM, so the mask is handed over as a ready
4-D additive mask, which transformers passes to the attention unchanged (eager and SDPA; flash
attention takes no 4-D mask).
"""

from __future__ import annotations

import torch
from torch import nn

ACTION_HEADS = ("autoregressive", "parallel", "flow")


class ActionQueries(nn.Module):
    """N learned input embeddings [N, H], one per action-token position."""

    def __init__(self, num_tokens: int, hidden_size: int, std: float):
        super().__init__()
        # The std of the backbone's own embedding init: queries start on the scale of token inputs.
        self.weight = nn.Parameter(torch.randn(num_tokens, hidden_size) * std)

    def forward(self, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, N, H] in `dtype`. A copy, not a view: ZeRO-3 frees the gathered weight right after."""
        return self.weight.to(dtype).unsqueeze(0).repeat(batch, 1, 1)


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
