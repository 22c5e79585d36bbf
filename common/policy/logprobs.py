"""The log-prob math of the action tokens, shared by sampling (act) and training (evaluate).

Only the action-token ids of the vocabulary compete: the logits are sliced to the n_bins action
ids before the softmax, which is the same as masking every other id to -inf and renormalising.
The temperature T divides the logits for both sampling and evaluation, so the behaviour
log-probs an actor reports and the log-probs the learner recomputes describe one distribution.
"""

from __future__ import annotations

import torch

LOGPROB_LEVELS = ("token_level", "action_level", "chunk_level")


def action_log_softmax(action_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) over the action bins (last dim), in fp32 whatever the model dtype."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    return torch.log_softmax(action_logits.float() / temperature, dim=-1)


def token_logprobs(action_logits: torch.Tensor, bins: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each chosen bin and the entropy of each token's distribution.

    action_logits [..., N, n_bins], bins int64 [..., N] (0 .. n_bins-1) -> (logp [..., N], entropy [..., N]).
    """
    logp_all = action_log_softmax(action_logits, temperature)
    logp = logp_all.gather(-1, bins.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def reduce_logprobs(token_logp, level: str, num_action_chunks: int, action_dim: int):
    """Sum per-token values into per-action (K) or per-chunk (1) values: [..., N] -> [..., M].

    An action is the D consecutive tokens of one env step, a chunk all N = K*D tokens. Entropies
    reduce the same way (sum of the per-token entropies). Numpy input is summed by torch too, so a
    behaviour log-prob reduced on either side has the same rounding as evaluate's.
    """
    if not isinstance(token_logp, torch.Tensor):
        return reduce_logprobs(torch.as_tensor(token_logp), level, num_action_chunks, action_dim).numpy()
    n = num_action_chunks * action_dim
    if token_logp.shape[-1] != n:
        raise ValueError(f"expected {n} token values (K={num_action_chunks} x D={action_dim}) in the last "
                         f"dim; got shape {tuple(token_logp.shape)}")
    lead = tuple(token_logp.shape[:-1])
    if level == "token_level":
        return token_logp
    if level == "action_level":
        return token_logp.reshape(lead + (num_action_chunks, action_dim)).sum(-1)
    if level == "chunk_level":
        return token_logp.reshape(lead + (1, n)).sum(-1)
    raise ValueError(f"logprob_type={level!r} is not allowed; choose one of {list(LOGPROB_LEVELS)}")
