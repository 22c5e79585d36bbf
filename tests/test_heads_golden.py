"""Every action head acts and scores as it did when tests/golden/heads.npz was written (the first
four before the heads moved into common/policy/heads/, the Gaussian head when it came): the same
sampled actions and log-probs from the same weights, inputs and seeds, and the same evaluate()
log-probs, entropies and values at each log-prob level. A refactor of the heads must keep them.

    python -m tests.test_heads_golden --write      # only when a head is meant to change
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncvla.common.config import FlowConfig, PolicyConfig
from asyncvla.common.policy import VLAPolicy

GOLDEN = Path(__file__).parent / "golden" / "heads.npz"
HEADS = {"autoregressive": {}, "parallel": {}, "flow_sde": {"flow": {"noise_method": "flow_sde"}},
         "flow_noise": {"flow": {"noise_method": "flow_noise"}}, "gaussian": {}}
LEVELS = ("token_level", "action_level", "chunk_level")
BATCH = 3


def head_policy(name: str) -> VLAPolicy:
    """A tiny random-init policy with the head `name`, its heads' weights drawn from a fixed seed."""
    extra = HEADS[name]
    flow = FlowConfig(**extra["flow"]) if "flow" in extra else FlowConfig()
    cfg = PolicyConfig(action_head="flow" if name.startswith("flow") else name, flow=flow, state_dim=5,
                       action_dim=3, num_action_chunks=2, n_bins=32, is_lora=False, value_encoder="cnn",
                       value_head_hidden=16, init_seed=3)
    cfg.backbone.text_layers, cfg.backbone.text_hidden_size, cfg.backbone.intermediate_size = 2, 64, 128
    cfg.backbone.vision_layers, cfg.backbone.vision_hidden_size = 1, 32
    torch.manual_seed(0)
    return VLAPolicy.build(cfg).eval()


def outputs(name: str) -> dict[str, np.ndarray]:
    """What the head gives on fixed inputs: act() sampled (and greedy), then evaluate() of the
    sampled actions at every log-prob level."""
    policy = head_policy(name)
    rng = np.random.default_rng(11)
    image = rng.integers(0, 256, (BATCH, 64, 64, 3), dtype=np.uint8)
    ids, mask = policy.tokenize(["push the cube", "lift the peg", ""])
    state = rng.standard_normal((BATCH, 5)).astype(np.float32)
    out = policy.act(image, ids, mask, state, generator=torch.Generator().manual_seed(5))
    greedy = policy.act(image, ids, mask, state, greedy=True)
    rec = {"actions": out.actions, "logprobs": out.logprobs, "values": out.values, "greedy_actions": greedy.actions,
           **out.replay}
    with torch.no_grad():
        for level in LEVELS:
            ev = policy.evaluate(image, ids, mask, state, out.replay, level)
            rec[f"{level}/logprobs"], rec[f"{level}/entropy"] = ev.logprobs.numpy(), ev.entropy.numpy()
            rec[f"{level}/values"] = ev.values.numpy()
    return {k: np.asarray(v) for k, v in rec.items()}


@pytest.mark.parametrize("name", list(HEADS))
def test_each_head_acts_and_scores_as_recorded(name):
    golden = np.load(GOLDEN)
    got = outputs(name)
    recorded = {k.split(":", 1)[1]: golden[k] for k in golden.files if k.startswith(f"{name}:")}
    assert set(got) == set(recorded), (sorted(got), sorted(recorded))
    for k, want in recorded.items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {k}")


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, **{f"{name}:{k}": v for name in HEADS for k, v in outputs(name).items()})
    print(f"wrote {GOLDEN}")
