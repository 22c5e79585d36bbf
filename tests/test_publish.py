"""EMA of published weights against a naive loop, and gathering from a plain module (the ZeRO-3
gather on real ranks is in test_engine)."""

import pytest
import torch
from torch import nn

from asyncvla.learner.publish import (EmaWeights, Publisher, gather_trainable, local_trainable, nonfinite,
                                     trainable_finite, unwrap)


def snapshots(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(n)]


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.99])
def test_ema_matches_a_naive_loop(decay):
    thetas = snapshots(6)
    ema = EmaWeights(decay)
    for k, theta in enumerate(thetas):
        out = ema.update(theta)
        for name in theta:
            expected = thetas[0][name].double()
            for later in thetas[1:k + 1]:
                expected = decay * expected + (1 - decay) * later[name].double()
            assert torch.allclose(out[name].double(), expected, rtol=0, atol=1e-6)
    assert ema.timings["ema_s"] >= 0 and ema.updates == 6


def test_ema_keeps_fp32_and_casts_copies_for_publishing():
    ema = EmaWeights(0.999, dtype=torch.bfloat16)
    theta = {"w": torch.ones(4, dtype=torch.bfloat16)}
    ema.update(theta)
    out = ema.update({"w": torch.full((4,), 1.5, dtype=torch.bfloat16)})
    assert out["w"].dtype == torch.bfloat16 and ema.shadow["w"].dtype == torch.float32
    assert ema.shadow["w"][0].item() == pytest.approx(1.0005)      # a bf16 shadow would stay at 1.0
    out["w"].zero_()
    assert ema.shadow["w"][0].item() != 0                            # published tensors are copies


def test_ema_state_round_trip_and_name_check():
    a = EmaWeights(0.5)
    for theta in snapshots(3):
        a.update(theta)
    b = EmaWeights(0.5)
    b.load_state_dict(a.state_dict())
    nxt = snapshots(1, seed=1)[0]
    assert all(torch.equal(a.update(nxt)[k], b.update(nxt)[k]) for k in nxt)
    with pytest.raises(KeyError, match="missing"):
        b.update({"w": nxt["w"]})
    with pytest.raises(ValueError):
        EmaWeights(1.0)
    with pytest.raises(ValueError):
        b.load_state_dict({"decay": 0.5})


class Wrapper(nn.Module):
    """Stands in for a DeepSpeed engine: the user's model under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_gather_from_a_plain_module_ships_only_trainable_fp32_copies():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    out = gather_trainable(Wrapper(model))
    assert sorted(out) == ["1.bias", "1.weight"]                    # no "module." prefix, no frozen
    assert all(t.dtype == torch.float32 for t in out.values())
    assert torch.equal(out["1.weight"], model[1].weight.float())
    out["1.weight"].zero_()
    assert model[1].weight.abs().sum() > 0
    small = gather_trainable(model, bucket_numel=3)                  # several buckets, same result
    assert sorted(small) == sorted(out) and torch.equal(small["1.bias"], model[1].bias.float())
    assert unwrap(model) is model


def test_publisher_gathers_averages_and_serves_with_timings():
    model, server = nn.Linear(3, 2), Server()
    rank0, other = Publisher(0.5, rank0=True), Publisher(0.5, rank0=False)
    rank0.server = server
    timings = rank0.publish(model, 1, 10)
    assert set(timings) == {"gather_s", "ema_s", "serve_s"} and server.served == [(1, 10, ["bias", "weight"])]
    assert torch.equal(rank0.ema.shadow["weight"], model.weight.detach())
    with torch.no_grad():
        model.weight.add_(2.0)
    rank0.publish(model, 2, 20)
    assert torch.allclose(rank0.ema.shadow["weight"], model.weight.detach() - 1.0)
    assert other.ema is None and other.ema_state() is None        # other ranks only gather
    assert set(other.publish(model, 2, 20)) == {"gather_s", "ema_s", "serve_s"}


def test_nonfinite_names_the_first_tensor_with_nan_or_inf():
    assert nonfinite([("a", torch.ones(2))]) is None
    assert nonfinite([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("inf")])),
                      ("c", torch.tensor([float("nan")]))]) == "b"
    model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    with torch.no_grad():
        model.bias[0] = float("nan")
    assert trainable_finite(model)                       # frozen weights are not trained nor published
    with torch.no_grad():
        model.weight[1, 0] = float("inf")
    assert not trainable_finite(Wrapper(model)) and nonfinite(local_trainable(Wrapper(model))) == "weight"


class Server:
    """Stands in for the weight server: records what it is asked to serve."""

    def __init__(self):
        self.served = []

    def publish(self, version, tensors, step):
        self.served.append((version, step, sorted(tensors)))


def test_republish_serves_the_restored_ema_weights_but_never_non_finite_ones():
    publisher, server = Publisher(0.5, rank0=True), Server()
    publisher.restore({"shadow": {"w": torch.ones(3), "b": torch.zeros(2)}, "updates": 4})
    publisher.server = server
    publisher.republish(7, 70)
    assert server.served == [(7, 70, ["b", "w"])]
    publisher.ema.shadow["w"][1] = float("nan")          # as a checkpoint with one NaN in place restores it
    with pytest.raises(ValueError, match=r"tensor 'w'.*version 8 not served"):
        publisher.republish(8, 80)
    assert len(server.served) == 1
