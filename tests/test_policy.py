"""The VLA policy on the tiny Idefics3 backbone: log-prob agreement of act and evaluate (both action
heads), the action tokenizer, LoRA / trainable tensors, save and load, input errors, a gradient step,
and what the parallel head promises (one pass per act, no sampled token fed back)."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncvla.common.config import PolicyConfig
from asyncvla.common.policy import ActionTokenizer, VLAPolicy, reduce_logprobs, token_logprobs
from asyncvla.common.policy.heads.queries import query_attention_mask
from asyncvla.common.policy.backbone import write_tiny_backbone

# Different lengths (including empty) so that left padding matters.
INSTRUCTIONS = ["push the cube to the goal region", "lift the peg", ""]
K, D = 4, 7
N = K * D


def observation(policy, batch=3, seed=0):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (batch, 64, 64, 3), dtype=np.uint8)
    ids, mask = policy.tokenize([INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)])
    return image, ids, mask


def perturb(policy, seed):
    """Give LoRA-B non-zero values (peft starts them at 0, where the adapter does nothing) and new heads."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B" in name or name.startswith(("value_head.", "action_queries.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


@pytest.fixture(scope="module")
def policy():
    return perturb(VLAPolicy.build(PolicyConfig()), seed=1)


@pytest.fixture(scope="module", params=["autoregressive", "parallel"])
def either(request):
    """A perturbed policy with each action head."""
    return perturb(VLAPolicy.build(PolicyConfig(action_head=request.param)), seed=1)


@pytest.fixture(scope="module")
def parallel():
    return perturb(VLAPolicy.build(PolicyConfig(action_head="parallel")), seed=5)


@pytest.fixture(scope="module")
def fresh():
    return VLAPolicy.build(PolicyConfig())


def evaluate_np(policy, image, ids, mask, tokens, level="token_level", **kw):
    with torch.no_grad():
        out = policy.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type=level, **kw)
    return [x.numpy() for x in (out.logprobs, out.entropy, out.values)]


# ------------------------------------------------------------------------- pure pieces
def test_action_tokenizer_round_trips():
    tok = ActionTokenizer(n_bins=256, vocab_size=512)
    assert tok.first_id == 256
    tokens = np.random.default_rng(0).integers(256, 512, size=(50, N))
    assert np.array_equal(tok.encode(tok.decode(tokens)), tokens)
    actions = np.random.default_rng(1).uniform(-1.3, 1.3, size=(50, K, D)).astype(np.float32)
    actions[0, 0, :3] = [-1.0, 0.0, 1.0]
    back = tok.decode(tok.encode(actions))
    assert back.dtype == np.float32 and back.shape == actions.shape
    assert np.abs(back - np.clip(actions, -1, 1)).max() <= 2 / 256 / 2 + 1e-6
    t = tok.encode(torch.tensor([[-1.0, 1.0]]))  # torch in, torch out; ends map to the end bins
    assert isinstance(t, torch.Tensor) and t.tolist() == [[256, 511]]
    with pytest.raises(ValueError, match=r"\[256, 512\)"):
        tok.decode(np.array([3]))
    with pytest.raises(ValueError, match="NaN"):
        tok.encode(np.array([np.nan]))


def test_per_dimension_action_range_matches_a_naive_loop():
    low, high = (-0.2, 0.0, -1.0), (0.3, 0.1, 1.0)
    tok = ActionTokenizer(n_bins=32, vocab_size=64, low=low, high=high)
    actions = np.random.default_rng(2).uniform(-1, 1, size=(20, 4, 3)).astype(np.float32)
    tokens = tok.encode(actions.reshape(20, -1))           # [B, K * D], as the policy lays them out
    centres = tok.decode(tokens).reshape(20, 4, 3)
    for b, k, d in np.ndindex(20, 4, 3):
        width = (high[d] - low[d]) / 32
        expect = min(max(int(np.floor((actions[b, k, d] - low[d]) / width)), 0), 31)
        assert tokens[b, k * 3 + d] == 32 + expect
        assert centres[b, k, d] == pytest.approx(low[d] + (expect + 0.5) * width, abs=1e-6)
    with pytest.raises(ValueError, match="multiple of the 3 action dims"):
        tok.encode(np.zeros((1, 4)))
    with pytest.raises(ValueError, match="high > low"):
        ActionTokenizer(n_bins=32, vocab_size=64, low=(0.0, 0.5), high=(1.0, 0.5))


def test_reduce_logprobs_matches_a_loop():
    x = torch.randn(2, 3, N, dtype=torch.float64)
    action = torch.zeros(2, 3, K, dtype=torch.float64)
    for k in range(K):
        for d in range(D):
            action[..., k] += x[..., k * D + d]
    assert torch.allclose(reduce_logprobs(x, "action_level", K, D), action)
    assert torch.allclose(reduce_logprobs(x, "chunk_level", K, D)[..., 0], action.sum(-1))
    assert reduce_logprobs(x, "token_level", K, D) is x
    assert np.allclose(reduce_logprobs(x.numpy(), "action_level", K, D), action.numpy())
    with pytest.raises(ValueError, match="token_level"):
        reduce_logprobs(x, "step_level", K, D)
    with pytest.raises(ValueError, match="28"):
        reduce_logprobs(x[..., :5], "chunk_level", K, D)


def test_token_logprobs_equal_masked_full_vocabulary_softmax():
    vocab, n_bins, temp = 40, 8, 0.7
    logits = torch.randn(3, 5, vocab, dtype=torch.float64)
    bins = torch.randint(0, n_bins, (3, 5))
    logp, ent = token_logprobs(logits[..., vocab - n_bins:], bins, temp)
    for b in range(3):
        for i in range(5):
            masked = torch.full((vocab,), float("-inf"), dtype=torch.float64)
            masked[vocab - n_bins:] = logits[b, i, vocab - n_bins:] / temp
            p = torch.softmax(masked, 0)[vocab - n_bins:]
            assert abs(float(logp[b, i]) - float(torch.log(p[bins[b, i]]))) < 1e-6
            assert abs(float(ent[b, i]) - float(-(p * p.log()).sum())) < 1e-6


# ------------------------------------------------------------------------- act / evaluate
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_evaluate_reproduces_act_logprobs_and_values(either, temperature):
    policy = either
    image, ids, mask = observation(policy)
    out = policy.act(image, ids, mask, temperature=temperature, generator=torch.Generator().manual_seed(3))
    assert out.actions.shape == (3, K, D) and out.actions.dtype == np.float32
    assert out.replay["action_tokens"].shape == (3, N) and out.replay["action_tokens"].dtype == np.int64
    assert out.logprobs.shape == (3, N) and out.values.shape == (3,)
    assert np.array_equal(out.actions, policy.action_tokenizer.decode(out.replay["action_tokens"]).reshape(3, K, D))
    for level, m in [("token_level", N), ("action_level", K), ("chunk_level", 1)]:
        logp, entropy, values = evaluate_np(policy, image, ids, mask, out.replay["action_tokens"], level,
                                            temperature=temperature)
        assert logp.shape == entropy.shape == (3, m)
        expected = reduce_logprobs(out.logprobs, level, K, D)
        assert np.abs(logp - expected).max() <= 1e-5, level
        assert np.abs(values - out.values).max() <= 1e-5
        assert (entropy > 0).all() and (entropy <= N * np.log(256) + 1e-3).all()


def test_padding_columns_are_dropped_without_changing_the_outputs(either):
    policy = either
    image, ids, mask = observation(policy)
    assert not mask.any(0).all(), "the instructions should leave columns that are padding in every row"
    out = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(3))
    bins = torch.as_tensor(out.replay["action_tokens"]) - policy.action_tokenizer.first_id
    # Reference: the whole padded prompt, every column kept (the inputs as they were before the drop).
    with torch.no_grad():
        full = policy._prompt(torch.as_tensor(image), torch.as_tensor(ids), torch.as_tensor(mask).long(), None)
        assert full[0].shape[1] > policy._prompt(*policy._inputs(image, ids, mask, None))[0].shape[1]
        logits, values = policy.head.logits(policy, full, bins)
        logp, entropy = token_logprobs(logits, bins, policy.temperature)
    assert np.abs(logp.numpy() - out.logprobs).max() <= 1e-5
    assert np.abs(values.numpy() - out.values).max() <= 1e-5
    ev = policy.evaluate(image, ids, mask, None, out.replay)
    assert torch.allclose(ev.entropy, entropy, atol=1e-5, rtol=0)


def test_temperature_shapes_the_distribution(policy):
    image, ids, mask = observation(policy)
    tokens = policy.act(image, ids, mask, greedy=True).replay["action_tokens"]
    hot = evaluate_np(policy, image, ids, mask, tokens, temperature=2.0)
    cold = evaluate_np(policy, image, ids, mask, tokens, temperature=0.5)
    assert (hot[1] > cold[1]).all()  # entropy grows with temperature
    assert np.array_equal(evaluate_np(policy, image, ids, mask, tokens)[0],
                          evaluate_np(policy, image, ids, mask, tokens, temperature=policy.temperature)[0])


def test_greedy_is_deterministic_and_sampling_follows_the_generator(policy):
    image, ids, mask = observation(policy)
    a = policy.act(image, ids, mask, greedy=True)
    b = policy.act(image, ids, mask, greedy=True, temperature=0.3)
    assert np.array_equal(a.replay["action_tokens"], b.replay["action_tokens"])
    s1 = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(7))
    s2 = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(7))
    s3 = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(8))
    assert np.array_equal(s1.replay["action_tokens"], s2.replay["action_tokens"])
    assert not np.array_equal(s1.replay["action_tokens"], s3.replay["action_tokens"])
    # The first token's distribution is the same for all three: greedy holds its mode.
    assert (a.logprobs[:, 0] >= s1.logprobs[:, 0]).all() and (a.logprobs[:, 0] >= s3.logprobs[:, 0]).all()


def test_inputs_accept_torch_and_numpy_and_batch_rows_are_independent(policy):
    image, ids, mask = observation(policy)
    a = policy.act(image, ids, mask, greedy=True)
    b = policy.act(torch.from_numpy(image), torch.from_numpy(ids), torch.from_numpy(mask), greedy=True)
    assert np.array_equal(a.replay["action_tokens"], b.replay["action_tokens"])
    one = policy.act(image[1:2], ids[1:2], mask[1:2], greedy=True)
    assert np.array_equal(one.replay["action_tokens"][0], a.replay["action_tokens"][1])
    assert np.abs(one.logprobs[0] - a.logprobs[1]).max() < 1e-4


def test_forward_is_evaluate_and_root_owns_no_parameters(either):
    policy = either
    image, ids, mask = observation(policy)
    tokens = policy.act(image, ids, mask, greedy=True).replay["action_tokens"]
    with torch.no_grad():
        f = policy(image, ids, mask, None, replay={"action_tokens": tokens}, logprob_type="action_level")
        e = policy.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="action_level")
    for x, y in zip(f, e):
        assert torch.equal(x, y)
    assert list(policy.parameters(recurse=False)) == []
    v = policy.value(image, ids, mask)
    assert v.dtype == torch.float32 and torch.allclose(v, e.values, atol=1e-5)


# ------------------------------------------------------------------------- trainable tensors
def test_lora_leaves_only_adapters_and_value_head_trainable(policy):
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert set(trainable) == set(policy.trainable_state_dict())
    assert len(trainable) == 6 * 4 * 2 + 4  # 6 text layers x q/k/v/o x (A, B) + value-head MLP
    for name in trainable:
        assert name.startswith("value_head.") or (".lora_" in name and ".text_model." in name), name
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    assert any("vision_model" in n for n in frozen) and any("lm_head" in n for n in frozen)


def test_trainable_state_dict_makes_a_second_copy_identical(policy, fresh):
    image, ids, mask = observation(policy)
    tokens = policy.act(image, ids, mask, greedy=True).replay["action_tokens"]
    copy = VLAPolicy.build(PolicyConfig())
    before = evaluate_np(copy, image, ids, mask, tokens)
    assert np.abs(before[0] - evaluate_np(policy, image, ids, mask, tokens)[0]).max() > 1e-3
    copy.load_trainable_state_dict({k: v.numpy() for k, v in policy.trainable_state_dict().items()})
    mine, theirs = evaluate_np(copy, image, ids, mask, tokens), evaluate_np(policy, image, ids, mask, tokens)
    for x, y in zip(mine, theirs):
        assert np.array_equal(x, y)
    sd = policy.trainable_state_dict()
    sd.pop(next(iter(sd)))
    with pytest.raises(KeyError, match="1 missing"):
        copy.load_trainable_state_dict(sd)


def test_gradient_step_moves_logprobs_and_values_the_expected_way():
    pol = perturb(VLAPolicy.build(PolicyConfig()), seed=2).train()
    image, ids, mask = observation(pol)
    tokens = pol.act(image, ids, mask, generator=torch.Generator().manual_seed(0)).replay["action_tokens"]
    out = pol.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="chunk_level")
    target = out.values.detach() + 1.0
    loss = -out.logprobs.sum() + ((out.values - target) ** 2).sum()
    loss.backward()
    assert all(p.grad is None for n, p in pol.named_parameters() if not p.requires_grad)
    opt = torch.optim.SGD([p for p in pol.parameters() if p.requires_grad], lr=1e-3)
    opt.step()
    with torch.no_grad():
        after = pol.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="chunk_level")
    assert (after.logprobs > out.logprobs.detach()).all()
    assert ((after.values - target).abs() < (out.values.detach() - target).abs()).all()


def test_full_finetuning_trains_and_ships_every_tensor():
    pol = VLAPolicy.build(PolicyConfig(is_lora=False))
    names = [n for n, _ in pol.named_parameters()]
    assert all(p.requires_grad for p in pol.parameters())
    assert set(pol.trainable_state_dict()) == set(names) and not any(".lora_" in n for n in names)
    image, ids, mask = observation(pol, batch=2)
    out = pol.act(image, ids, mask, generator=torch.Generator().manual_seed(0))
    logp = evaluate_np(pol, image, ids, mask, out.replay["action_tokens"])[0]
    assert np.abs(logp - out.logprobs).max() <= 1e-5


def test_proprio_state_is_one_prompt_token():
    pol = perturb(VLAPolicy.build(PolicyConfig(state_dim=5)), seed=3)
    image, ids, mask = observation(pol, batch=2)
    state = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
    out = pol.act(image, ids, mask, state, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ev = pol.evaluate(image, ids, mask, state, out.replay)
        other = pol.evaluate(image, ids, mask, state + 1.0, out.replay)
    assert np.abs(ev.logprobs.numpy() - out.logprobs).max() <= 1e-5
    assert not torch.allclose(ev.logprobs, other.logprobs)
    assert "state_encoder.proj.weight" in pol.trainable_state_dict()
    with pytest.raises(ValueError, match="state_dim=5"):
        pol.act(image, ids, mask)


# ------------------------------------------------------------------------- save / load
def test_tiny_backbone_is_an_ordinary_checkpoint(tmp_path, fresh):
    from transformers import AutoConfig, AutoTokenizer
    path = write_tiny_backbone(str(tmp_path / "tiny"), PolicyConfig().backbone, 64, 256, seed=0)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert len(tok) <= 512 - 256  # text ids stay below the action ids
    loaded = VLAPolicy.build(PolicyConfig(pretrained_path=path))
    image, ids, mask = observation(fresh)
    a, b = loaded.act(image, ids, mask, greedy=True), fresh.act(image, ids, mask, greedy=True)
    assert np.array_equal(a.replay["action_tokens"], b.replay["action_tokens"]) and np.array_equal(a.logprobs, b.logprobs)


def test_save_pretrained_round_trip_gives_identical_outputs(tmp_path, either):
    policy = either
    path = str(tmp_path / "vla")
    policy.save_pretrained(path)
    for name in ("policy.json", "heads.safetensors", "adapter/adapter_model.safetensors",
                 "backbone/config.json", "backbone/model.safetensors", "backbone/tokenizer.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    heads = load_file(os.path.join(path, "heads.safetensors"))
    assert ("action_queries.weight" in heads) == (policy.cfg.action_head == "parallel")
    loaded = VLAPolicy.from_pretrained(path)
    image, ids, mask = observation(policy)
    a, b = policy.act(image, ids, mask, greedy=True), loaded.act(image, ids, mask, greedy=True)
    for x, y in zip(a, b):
        assert np.array_equal(x, y) if not isinstance(x, dict) else x.keys() == y.keys() and all(
            np.array_equal(x[k], y[k]) for k in x)
    for x, y in zip(evaluate_np(policy, image, ids, mask, a.replay["action_tokens"], "action_level"),
                    evaluate_np(loaded, image, ids, mask, a.replay["action_tokens"], "action_level")):
        assert np.array_equal(x, y)
    # As policy.pretrained_path it continues as saved; a structural mismatch is named.
    head = policy.cfg.action_head
    again = VLAPolicy.build(PolicyConfig(pretrained_path=path, temperature=0.5, action_head=head))
    assert again.temperature == 0.5
    assert np.array_equal(again.act(image, ids, mask, greedy=True).replay["action_tokens"], a.replay["action_tokens"])
    with pytest.raises(ValueError, match="n_bins=128"):
        VLAPolicy.build(PolicyConfig(pretrained_path=path, n_bins=128, action_head=head))
    other = "parallel" if head == "autoregressive" else "autoregressive"
    with pytest.raises(ValueError, match=f"action_head='{other}'.*saved with action_head='{head}'"):
        VLAPolicy.build(PolicyConfig(pretrained_path=path, action_head=other))


@pytest.mark.parametrize("missing", ["heads.safetensors", "adapter/adapter_model.safetensors", "policy.json",
                                     "backbone/config.json", "backbone/model.safetensors"])
def test_a_missing_piece_is_named(tmp_path_factory, policy, missing):
    path = str(tmp_path_factory.mktemp("vla"))
    policy.save_pretrained(path)
    os.remove(os.path.join(path, missing))
    with pytest.raises(FileNotFoundError, match=os.path.basename(missing).replace(".", r"\.")):
        VLAPolicy.from_pretrained(path)


# ------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(policy):
    image, ids, mask = observation(policy)
    with pytest.raises(ValueError, match=r"uint8 \[B, 64, 64, 3\].*got float32 \[3, 64, 64, 3\]"):
        policy.act(image.astype(np.float32), ids, mask)
    with pytest.raises(ValueError, match=r"got uint8 \[3, 32, 32, 3\]"):
        policy.act(image[:, :32, :32], ids, mask)
    with pytest.raises(ValueError, match="40 tokens per row; the limit is policy.max_instruction_tokens=32"):
        policy.act(image, np.zeros((3, 40), np.int64), np.ones((3, 40), np.uint8))
    with pytest.raises(ValueError, match=r"has \d+ tokens; the limit is policy.max_instruction_tokens=32"):
        policy.tokenize(["push the cube " * 20])
    tokens = policy.act(image, ids, mask, greedy=True).replay["action_tokens"]
    with pytest.raises(ValueError, match=r"\[B=3, N=28\].*got int64 \[3, 27\]"):
        policy.evaluate(image, ids, mask, None, {"action_tokens": tokens[:, :27]})
    with pytest.raises(ValueError, match=r"action-token ids in \[256, 512\)"):
        policy.evaluate(image, ids, mask, None, {"action_tokens": tokens - 256})
    with pytest.raises(ValueError, match="policy.state_dim=0"):
        policy.act(image, ids, mask, state=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="token_level"):
        policy.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="step")


def test_cached_sampling_logits_match_the_scoring_pass(policy):
    """Sampling reads KV-cached logits, the reported log-probs a teacher-forced pass: same distribution."""
    image, ids, mask = observation(policy)
    out = policy.act(image, ids, mask, greedy=True)
    with torch.no_grad():
        prompt = policy._prompt(*policy._inputs(image, ids, mask, None))
        bins = torch.from_numpy(out.replay["action_tokens"]) - policy.action_tokenizer.first_id
        embeds = torch.cat([prompt[0], policy.embed(torch.from_numpy(out.replay["action_tokens"][:, :-1]))], 1)
        attn = torch.ones(embeds.shape[:2], dtype=torch.long)
        attn[:, :prompt[1].shape[1]] = prompt[1]
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        hidden = policy.decode(embeds, attn, pos, cache=None, use_cache=False).last_hidden_state
        logits = policy.action_logits(hidden[:, prompt[0].shape[1] - 1:])
    assert torch.equal(logits.argmax(-1), bins)  # greedy = the mode of every scored position


def test_greedy_act_is_the_mode_of_evaluate(either):
    image, ids, mask = observation(either)
    out = either.act(image, ids, mask, greedy=True)
    bins = torch.from_numpy(out.replay["action_tokens"]) - either.action_tokenizer.first_id
    with torch.no_grad():
        logits, _ = either.head.logits(either, either._prompt(*either._inputs(image, ids, mask, None)), bins)
    assert torch.equal(logits.argmax(-1), bins)
    sampled = either.act(image, ids, mask, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert not np.array_equal(sampled.replay["action_tokens"], out.replay["action_tokens"])


# ------------------------------------------------------------------------- parallel action head
def lm_passes(policy, *args, **kwargs) -> int:
    """Forward calls of the language model during one act()."""
    calls = []
    hook = policy._vlm.model.text_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        policy.act(*args, **kwargs)
    finally:
        hook.remove()
    return len(calls)


def test_parallel_head_acts_in_one_backbone_pass(parallel, policy):
    image, ids, mask = observation(parallel)
    assert lm_passes(parallel, image, ids, mask, generator=torch.Generator().manual_seed(0)) == 1
    assert lm_passes(parallel, image, ids, mask, greedy=True) == 1
    # autoregressive: the prompt, N - 1 cached steps and the scoring pass
    assert lm_passes(policy, image, ids, mask, greedy=True) == N + 1


def test_parallel_head_outputs_do_not_depend_on_the_action_tokens(parallel, policy):
    """Changing every action token but position i leaves the parallel head's numbers for i (and
    all entropies, values and modes) bit-identical; the autoregressive head's change."""
    image, ids, mask = observation(parallel)
    i, rng = N // 2, np.random.default_rng(0)
    for pol in (parallel, policy):
        tokens = pol.act(image, ids, mask, generator=torch.Generator().manual_seed(0)).replay["action_tokens"]
        first = pol.action_tokenizer.first_id
        other = (tokens - first + rng.integers(1, 256, tokens.shape)) % 256 + first
        other[:, i] = tokens[:, i]
        with torch.no_grad():
            a = pol.evaluate(image, ids, mask, None, {"action_tokens": tokens})
            b = pol.evaluate(image, ids, mask, None, {"action_tokens": other})
        same_i = torch.equal(a.logprobs[:, i], b.logprobs[:, i])
        if pol is parallel:
            assert same_i and torch.equal(a.entropy, b.entropy) and torch.equal(a.values, b.values)
            assert not torch.equal(a.logprobs, b.logprobs)        # the changed tokens are scored
        else:
            assert not same_i


def test_action_queries_see_the_prompt_and_each_other_and_the_prompt_not_them(parallel):
    image, ids, mask = observation(parallel)
    tokens = parallel.act(image, ids, mask, greedy=True).replay["action_tokens"]
    base = evaluate_np(parallel, image, ids, mask, tokens)
    w = parallel.action_queries.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[-1].add_(1.0)                                       # the last query only
        moved = evaluate_np(parallel, image, ids, mask, tokens)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert (moved[1][:, 0] != base[1][:, 0]).all()                # the first token sees the last query
    assert np.array_equal(moved[2], base[2])                      # the value (last prompt token) does not
    assert (mask == 0).any()
    padded = np.where(mask == 0, 5, ids)                          # other ids under the padding
    assert np.array_equal(evaluate_np(parallel, image, padded, mask, tokens)[0], base[0])
    other = image.copy()
    other[0] = 255 - other[0]
    changed = evaluate_np(parallel, other, ids, mask, tokens)[0]
    assert not np.allclose(changed[0], base[0][0]) and np.array_equal(changed[1:], base[0][1:])


@pytest.mark.parametrize("bidirectional_prompt", [False, True])
@pytest.mark.parametrize("causal_queries", [False, True])
def test_query_attention_mask_matches_a_naive_loop(bidirectional_prompt, causal_queries):
    prompt_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    m = query_attention_mask(prompt_mask, 3, torch.float32, bidirectional_prompt, causal_queries)
    assert m.shape == (2, 1, 7, 7) and m.dtype == torch.float32
    for b, q, k in np.ndindex(2, 7, 7):
        key = k >= 4 or prompt_mask[b, k] == 1
        if q < 4:                                   # a prompt row
            allowed = key and k < 4 and (k <= q or bidirectional_prompt)
        else:                                       # a query (or fed-back action token) row
            allowed = key and (k < 4 or k <= q or not causal_queries)
        assert float(m[b, 0, q, k]) == (0.0 if allowed else torch.finfo(torch.float32).min), (b, q, k)


def test_action_queries_train_with_lora_and_ship_with_the_trainable_tensors(parallel, policy):
    assert not hasattr(policy, "action_queries") and not any("action_queries" in n for n in policy.state_dict())
    trainable = {n for n, p in parallel.named_parameters() if p.requires_grad}
    assert "action_queries.weight" in trainable and set(parallel.trainable_state_dict()) == trainable
    assert len(trainable) == 6 * 4 * 2 + 4 + 1
    image, ids, mask = observation(parallel)
    tokens = parallel.act(image, ids, mask, generator=torch.Generator().manual_seed(1)).replay["action_tokens"]
    copy = VLAPolicy.build(PolicyConfig(action_head="parallel"))
    assert not np.array_equal(evaluate_np(copy, image, ids, mask, tokens)[0],
                              evaluate_np(parallel, image, ids, mask, tokens)[0])
    copy.load_trainable_state_dict({k: v.numpy() for k, v in parallel.trainable_state_dict().items()})
    for x, y in zip(evaluate_np(copy, image, ids, mask, tokens), evaluate_np(parallel, image, ids, mask, tokens)):
        assert np.array_equal(x, y)
    copy.train()
    out = copy.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="chunk_level")
    (-out.logprobs.sum()).backward()
    assert copy.action_queries.weight.grad.abs().sum() > 0
    opt = torch.optim.SGD([p for p in copy.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    with torch.no_grad():
        after = copy.evaluate(image, ids, mask, None, {"action_tokens": tokens}, logprob_type="chunk_level")
    assert (after.logprobs > out.logprobs.detach()).all()


@pytest.mark.parametrize("head", ["autoregressive", "parallel"])
def test_bf16_backbone_keeps_fp32_heads_and_agrees_with_itself(tmp_path, head):
    pol = perturb(VLAPolicy.build(PolicyConfig(precision="bf16", action_head=head)), seed=4)
    assert pol._vlm.lm_head.weight.dtype == torch.bfloat16
    assert pol.value_head.fc1.weight.dtype == torch.float32
    image, ids, mask = observation(pol, batch=2)
    out = pol.act(image, ids, mask, generator=torch.Generator().manual_seed(0))
    logp, _, values = evaluate_np(pol, image, ids, mask, out.replay["action_tokens"])
    assert logp.dtype == np.float32 and np.array_equal(logp, out.logprobs)
    assert np.array_equal(values, out.values)
    pol.save_pretrained(str(tmp_path / "bf16"))
    as_fp32 = VLAPolicy.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    assert as_fp32._vlm.lm_head.weight.dtype == torch.float32
    assert np.abs(evaluate_np(as_fp32, image, ids, mask, out.replay["action_tokens"])[0] - logp).max() < 0.5


@pytest.mark.parametrize("size", [64, 128])
def test_image_preprocessing_matches_the_idefics3_processor(fresh, size):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from asyncvla.common.policy.backbone import ImageSpec
    yy, xx = np.mgrid[0:64, 0:64]
    image = np.stack([127 + 100 * np.sin(xx / 7.0 + c) * np.cos(yy / 5.0) for c in range(3)], -1)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)
    image = np.stack([image.astype(np.uint8), noise])
    proc = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size},
                                     max_image_size={"longest_edge": size})
    ref = proc(images=[[im] for im in image], return_tensors="pt")["pixel_values"][:, 0]
    spec, fresh.image_spec = fresh.image_spec, ImageSpec(model_size=size)
    try:
        mine = fresh._pixels(torch.from_numpy(image))
    finally:
        fresh.image_spec = spec
    assert mine.shape == ref.shape
    if size == 64:  # no resize: exact up to float rounding
        assert (mine - ref).abs().max() < 1e-6
    else:  # torch bicubic vs PIL Lanczos: close on a smooth image
        assert (mine[0] - ref[0]).abs().mean() < 0.01


def test_cnn_value_encoder_reads_the_image_ships_with_the_heads_and_round_trips(tmp_path):
    cfg = PolicyConfig(value_encoder="cnn", value_head_hidden=32, lora_rank=4)
    p = perturb(VLAPolicy.build(cfg), seed=3)
    trainable = [n for n, q in p.named_parameters() if q.requires_grad]
    assert any(n.startswith("value_head.encoder.") for n in trainable)       # trained and published
    image, ids, mask = observation(p)
    v = p.value(image, ids, mask)
    other = image.copy()
    other[0] = 255 - other[0]
    moved = p.value(other, ids, mask)
    assert moved[0] != v[0] and torch.equal(moved[1:], v[1:])               # the row's own image
    out = p.act(image, ids, mask, greedy=True)
    assert np.allclose(out.values, v.detach().numpy(), atol=1e-6)
    # the critic's gradient stops at the VLM: only the value head learns from the value loss
    p.zero_grad()
    p.evaluate(image, ids, mask, None, out.replay).values.sum().backward()
    grads = {n for n, q in p.named_parameters() if q.grad is not None and q.grad.abs().sum() > 0}
    assert grads and all(n.startswith("value_head.") for n in grads)
    p.save_pretrained(tmp_path / "p")
    q = VLAPolicy.from_pretrained(tmp_path / "p")
    assert q.cfg.value_encoder == "cnn" and torch.equal(q.value(image, ids, mask), v)


@pytest.mark.parametrize("head", ["parallel", "flow"])
def test_a_value_image_moves_only_the_values(head):
    """evaluate(value_image=...) (the learner's random shift of the critic's view): the values read
    it, every policy output is what the real image gives."""
    cfg = PolicyConfig(value_encoder="cnn", value_head_hidden=32, action_head=head)
    p = perturb(VLAPolicy.build(cfg), seed=4)
    image, ids, mask = observation(p)
    out = p.act(image, ids, mask, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = p.evaluate(image, ids, mask, None, out.replay)
        same = p.evaluate(image, ids, mask, None, out.replay, value_image=image)
        shifted = p.evaluate(image, ids, mask, None, out.replay, value_image=np.roll(image, 4, axis=2))
    assert torch.equal(same.values, plain.values)
    assert not torch.allclose(shifted.values, plain.values)
    assert torch.equal(shifted.logprobs, plain.logprobs) and torch.equal(shifted.entropy, plain.entropy)


@pytest.mark.parametrize("head", ["autoregressive", "parallel"])
def test_cnn_image_tokens_read_the_image_train_under_lora_and_round_trip(tmp_path, head):
    cfg = PolicyConfig(cnn_image_tokens=4, action_head=head, lora_rank=4)
    p = perturb(VLAPolicy.build(cfg), seed=3)
    assert any(n.startswith("image_tokens.") for n in p.trainable_state_dict())   # trained and published
    image, ids, mask = observation(p)
    out = p.act(image, ids, mask, generator=torch.Generator().manual_seed(0))
    ev = evaluate_np(p, image, ids, mask, out.replay["action_tokens"])
    assert np.abs(ev[0] - out.logprobs).max() <= 1e-5                          # act and evaluate agree
    # the tokens carry the image: changing the CNN alone moves the action distribution
    with torch.no_grad():
        p.image_tokens.proj.bias.add_(0.5)
    moved = evaluate_np(p, image, ids, mask, out.replay["action_tokens"])
    assert np.abs(moved[0] - ev[0]).max() > 1e-4
    p.save_pretrained(tmp_path / "p")
    q = VLAPolicy.from_pretrained(tmp_path / "p")
    assert q.cfg.cnn_image_tokens == 4
    assert np.array_equal(evaluate_np(q, image, ids, mask, out.replay["action_tokens"])[0], moved[0])
    with pytest.raises(ValueError, match="cnn_image_tokens=4"):
        VLAPolicy.build(PolicyConfig(pretrained_path=str(tmp_path / "p"), cnn_image_tokens=16, lora_rank=4,
                                     action_head=head))


def test_sincos_position_init_makes_patch_positions_distinct():
    from asyncvla.common.policy.positions import sincos_positions
    pe = sincos_positions(8, 64)
    assert pe.shape == (64, 64) and pe.abs().max() <= 1.0
    dist = torch.cdist(pe, pe) + torch.eye(64) * 1e9
    assert dist.min() > 0.5                          # every patch position is told apart
    emb = VLAPolicy.build(PolicyConfig())._vlm.model.vision_model.embeddings.position_embedding.weight
    side = int(emb.shape[0] ** 0.5)
    assert torch.allclose(emb, sincos_positions(side, emb.shape[1]))
