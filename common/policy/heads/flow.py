"""The flow head (pi0): continuous actions denoised by a small action expert reading the VLM.

One pass over the prompt gives every layer's hidden states and the value; the expert
(flow_expert.py) denoises the K x D chunk from them in policy.flow.num_steps steps, and acting
returns the chain with the steps that were Gaussian (flow_sampling.py: Flow-SDE, one random step;
Flow-Noise, every step, learned std). The replay is that chain: the learner recomputes the same
Gaussian log-probs from the same prompt pass with its weights. SFT is pi0's flow-matching loss.
"""

from __future__ import annotations

import torch

from asyncvla.common.transport.protocol import Field

from . import Acted, ActionHead, Scored, SFTLoss, register
from ..flow import flow_matching_loss, interpolate, sample_time
from ..flow_expert import FlowExpert
from ..flow_sampling import FlowSampling, chain_logprob, sample_chain


def check_chain(arrays) -> str | None:
    """What is wrong with a received chain's replay: a chunk without a Gaussian step has no log-prob."""
    s = arrays["flow_stochastic"]
    if s.size and not s.any(-1).all():
        return "'flow_stochastic' has a chunk with no Gaussian step: its log-prob cannot be recomputed"
    return None


@register
class FlowHead(ActionHead):
    name = "flow"
    densities = True
    sft_draws = True

    @property
    def sampling(self) -> FlowSampling:
        f = self.cfg.flow
        return FlowSampling(f.num_steps, f.noise_method, f.noise_level, f.log_std_min, f.log_std_max)

    def modules(self, hidden_size, init_std):
        c, f = self.cfg, self.cfg.flow
        return {"flow_expert": FlowExpert(c.action_dim, c.num_action_chunks, hidden_size, f.width, f.depth, f.heads,
                                          f.kv_heads, f.head_dim, f.mlp, learn_noise=f.noise_method == "flow_noise")}

    def replay_fields(self) -> dict:
        # n denoising steps: the chain's n + 1 points (noise ... the chunk in [-1, 1]), and which
        # of the n steps were Gaussian.
        n = self.cfg.flow.num_steps
        return {"flow_chain": Field("float32", (n + 1, "K", "D"), "step", "unit"),
                "flow_stochastic": Field("uint8", (n,), "step")}

    def check_replay(self, arrays):
        return check_chain(arrays)

    def act(self, policy, prompt, temperature, greedy, generator) -> Acted:
        kv, values, _ = self._prefix(policy, prompt)
        b, k, d = prompt[0].shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        out = sample_chain(policy.flow_expert, self.sampling, kv, prompt[1], (b, k, d), greedy, generator)
        actions = policy.action_tokenizer.from_unit(out.chain[:, -1].reshape(b, k * d)).reshape(b, k, d)
        replay = {"flow_chain": out.chain, "flow_stochastic": out.stochastic.to(torch.uint8)}
        return Acted(actions, replay, out.logp.reshape(b, k * d), values.float())

    def evaluate(self, policy, prompt, replay, temperature) -> Scored:
        b, k, d = prompt[0].shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        chain, stochastic = self._chain(policy, replay, b)
        kv, values, _ = self._prefix(policy, prompt)
        logp, entropy = chain_logprob(policy.flow_expert, self.sampling, kv, prompt[1], chain, stochastic)
        return Scored(logp.reshape(b, k * d), entropy.reshape(b, k * d), values)

    def sft_loss(self, policy, prompt, actions, generator) -> SFTLoss:
        """pi0's flow-matching loss on the demo chunk [B, K, D] (env units, mapped to [-1, 1] with
        the policy's action range) at times from Beta(policy.flow.time_alpha, 1)."""
        b, k, d = actions.shape[0], self.cfg.num_action_chunks, self.cfg.action_dim
        target = policy.action_tokenizer.to_unit(actions.to(policy.device, torch.float32).reshape(b, k * d))
        target = target.reshape(b, k, d)
        kv, values, vlm_dtype = self._prefix(policy, prompt)
        dev = generator.device if generator is not None else policy.device
        noise = torch.randn(target.shape, generator=generator, device=dev).to(policy.device)
        t = sample_time((b,), generator, self.cfg.flow.time_alpha).to(policy.device)
        x_t, _ = interpolate(target, noise, t)
        velocity = policy.flow_expert(x_t.to(vlm_dtype), t, kv, prompt[1])
        return SFTLoss(flow_matching_loss(velocity, target, noise).expand(b), values, {})

    def freezes_backbone(self) -> bool:
        return self.cfg.flow.train_expert_only

    def adapt(self, policy, cfg) -> None:
        """The noise method is RL's choice, not the checkpoint's: add (seeded by policy.init_seed) or
        drop Flow-Noise's noise network."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            policy.flow_expert.set_learn_noise(cfg.flow.noise_method == "flow_noise")

    @staticmethod
    def _prefix(policy, prompt):
        """The prompt alone -> the expert's keys and values of the VLM's hidden states of every
        layer (computed once per chunk), the value [B], and the VLM's dtype."""
        embeds, attn, pos, image = prompt
        out = policy.decode(embeds, policy.prompt_mask(attn, embeds.dtype), pos, cache=None, use_cache=False,
                            output_hidden_states=True)
        hidden_states = out.hidden_states
        kv = policy.flow_expert.prefix_kv(hidden_states, len(hidden_states) - 1)
        return kv, policy.value_head(out.last_hidden_state[:, -1], image), hidden_states[-1].dtype

    def _chain(self, policy, replay, batch: int):
        n, k, d = self.cfg.flow.num_steps, self.cfg.num_action_chunks, self.cfg.action_dim
        chain, stochastic = replay.get("flow_chain"), replay.get("flow_stochastic")
        if chain is None or stochastic is None:
            raise ValueError("a flow-head policy evaluates chains: pass flow_chain and flow_stochastic "
                             "(act's replay), not action tokens")
        chain, stochastic = torch.as_tensor(chain), torch.as_tensor(stochastic)
        if tuple(chain.shape) != (batch, n + 1, k, d) or not chain.is_floating_point():
            raise ValueError(f"flow_chain must be float [B={batch}, S+1={n + 1}, K={k}, D={d}] "
                             f"(policy.flow.num_steps={n}); got {str(chain.dtype).replace('torch.', '')} "
                             f"{list(chain.shape)}")
        if tuple(stochastic.shape) != (batch, n):
            raise ValueError(f"flow_stochastic must be [B={batch}, S={n}]; got {list(stochastic.shape)}")
        if not torch.isfinite(chain).all():
            raise ValueError("flow_chain holds NaN or inf")
        return chain.to(policy.device, torch.float32), stochastic.to(policy.device).bool()
