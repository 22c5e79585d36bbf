"""The parallel token head (OpenVLA-OFT): all N = K*D action tokens from one pass over the prompt
and N learned action queries (queries.py). No sampled token is fed back, so acting costs one pass
of the language model instead of N, and the learner's pass is that same pass (the action tokens
never enter the input)."""

from __future__ import annotations

from . import register
from .queries import ActionQueries, query_pass
from .tokens import TokenHead, choose


@register
class ParallelHead(TokenHead):
    name = "parallel"

    def modules(self, hidden_size, init_std):
        return {"action_queries": ActionQueries(self.cfg.num_action_chunks * self.cfg.action_dim, hidden_size,
                                                init_std)}

    def draw(self, policy, prompt, temperature, greedy, generator):
        made = self.logits(policy, prompt, None)
        return choose(made[0], temperature, greedy, generator), made

    def logits(self, policy, prompt, bins):
        """-> action logits [B, N, n_bins] (the hidden state at query i predicts token i), values [B]."""
        hidden, values = query_pass(policy, prompt, policy.action_queries)
        return policy.action_logits(hidden), values
