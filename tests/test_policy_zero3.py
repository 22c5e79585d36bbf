"""The policy inside a real DeepSpeed ZeRO-3 engine (one CPU rank, in a child process so its process
group stays out of the test session), with each action head: the engine's forward is evaluate, a
step moves the policy, and the gathered trainable tensors make a plain copy produce the engine's
outputs."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.ports import free_ports

SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch, deepspeed, torch.distributed as dist
    from asyncvla.common.config import PolicyConfig
    from asyncvla.common.policy import VLAPolicy
    from asyncvla.learner.engine import skip_cpu_shm_op

    cfg = PolicyConfig(action_head=sys.argv[1])
    policy = VLAPolicy.build(cfg)
    image = np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    ids, mask = policy.tokenize(["push the cube to the goal region", "lift the peg"] * 2)
    replay = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(0)).replay
    with torch.no_grad():
        ref = policy.evaluate(image, ids, mask, None, replay)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    skip_cpu_shm_op()                   # as the learner does: no op compile on a fresh machine
    engine, *_ = deepspeed.initialize(model=policy, config=config,
                                      model_parameters=[p for p in policy.parameters() if p.requires_grad])
    vision = policy._vlm.model.vision_model.embeddings.patch_embedding.weight
    assert vision.numel() == 0, "ZeRO-3 did not partition the backbone"
    queries = getattr(policy, "action_queries", None)
    assert queries is None or queries.weight.numel() == 0, "ZeRO-3 did not partition the action queries"
    out = engine(image, ids, mask, None, replay=replay)
    assert torch.allclose(out.logprobs, ref.logprobs, atol=1e-5)
    assert torch.allclose(out.values, ref.values, atol=1e-5)
    engine.backward(-out.logprobs.sum() + out.values.square().sum())
    engine.step()
    with torch.no_grad():
        after = engine(image, ids, mask, None, replay=replay, logprob_type="chunk_level")
    assert not torch.allclose(after.logprobs[:, 0], out.logprobs.detach().sum(-1))   # the step moved the policy
    trainable = [p for n, p in policy.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trainable):
        shipped = policy.trainable_state_dict()
    copy = VLAPolicy.build(cfg)
    if queries is not None:  # trained and shipped with the LoRA tensors
        assert not torch.equal(shipped["action_queries.weight"], copy.action_queries.weight)
    copy.load_trainable_state_dict(shipped)
    with torch.no_grad():
        mine = copy.evaluate(image, ids, mask, None, replay, logprob_type="chunk_level")
    assert torch.allclose(mine.logprobs, after.logprobs, atol=1e-4), (mine.logprobs, after.logprobs)
    dist.barrier()
    dist.destroy_process_group()
    print("ZERO3-OK")
""")


@pytest.mark.parametrize("head", ["autoregressive", "parallel", "gaussian"])
def test_policy_trains_inside_a_zero3_engine(head):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_ports(1)[0]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, head], env=env, capture_output=True, text=True,
                          timeout=500)
    assert proc.returncode == 0 and "ZERO3-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
