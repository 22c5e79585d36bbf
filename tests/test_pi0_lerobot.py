"""π0 and π0.5 from LeRobot 0.4.3 policy directories (common/policy/pi0/), without LeRobot.

What is checked, and against what:
  * At the published shape (lerobot/pi0_base, pi05_base: PaliGemma gemma_2b + SigLIP so400m/14 at
    224 px, expert gemma_300m, chunk 50, state/action 32), on the meta device: every parameter's name
    and shape, and the counts in all and per part, equal LeRobot's own PI0Policy / PI05Policy built on
    the meta device (tests/golden/pi0/pi0_params.json, pi05_params.json, written by
    tests/interop/pi0_side.py count). LeRobot's class was built with a stub for its import-time check
    of the patched transformers and, for π0.5, with the expert's norms swapped for openpi's adaRMS
    norm (PyPI's transformers ignores use_adarms): see that script's docstring.
  * On tiny random-init directories written here in LeRobot's layout (config.json with PI0Config's /
    PI05Config's keys, model.safetensors with LeRobot's names, processor JSON and statistics files as
    LeRobot writes them; the file holds PaliGemma's lm_head.weight and not the tied embed_tokens, as
    the published files do): loading, acting (shape, finiteness, determinism in the noise, dependence
    on noise and image), the prefix key/value cache against a joint pass over prefix and suffix (the
    path LeRobot trains with), and one-line refusals. LeRobot accepts only the variants gemma_300m
    and gemma_2b; the tiny sizes are added to asyncvla's variant table by the fixture below.
NOT checked: actions against LeRobot's (LeRobot's π0 does not build on PyPI's transformers, so no
reference outputs can be made here), and no real checkpoint is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from asyncvla.common.config import PolicyConfig
from asyncvla.common.policy import kinds
from asyncvla.common.policy.lerobot_dir import LeRobotDirError
from asyncvla.common.policy.pi0 import PI0, released, spec as pi0_spec
from asyncvla.common.policy.pi0.network import (TIED, PI0Net, attention, attention_mask, residual, rms_norm,
                                                time_features)

GOLDEN = Path(__file__).parent / "golden" / "pi0"
TINY_VLM = pi0_spec.Gemma(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=300,
                          vision=pi0_spec.Siglip(hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                                 num_attention_heads=2, patch_size=14))
TINY_EXPERT = pi0_spec.Gemma(width=24, depth=2, mlp_dim=48, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=300)
CHUNK, STATE, ACTION, MAX = 6, 5, 3, 8
CAMERAS = ("observation.images.base_0_rgb", "observation.images.wrist_0_rgb")
TASKS = ["push the cube to the goal", "pick_up the red block"]


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def tiny_variants():
    pi0_spec.VARIANTS.update(tiny_vlm=TINY_VLM, tiny_expert=TINY_EXPERT)
    yield
    for name in ("tiny_vlm", "tiny_expert"):
        pi0_spec.VARIANTS.pop(name)


def build_tokenizer(out: Path) -> None:
    """A tiny tokenizer standing in for PaliGemma's (which puts <bos> first), trained offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TASKS + ["Task: State: Action: 0 1 2 3 4 5 6 7 8 9 ; , \n"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)


def lerobot_config(kind: str) -> dict:
    """config.json as LeRobot's PI0Config / PI05Config saves it (its keys), at the tiny shape."""
    base = json.loads(json.dumps(released.RELEASED[kind]))
    camera = {"type": "VISUAL", "shape": [3, 28, 28]}
    base.update({
        "input_features": {**{k: camera for k in CAMERAS}, "observation.state": {"type": "STATE", "shape": [STATE]}},
        "output_features": {"action": {"type": "ACTION", "shape": [ACTION]}},
        "paligemma_variant": "tiny_vlm", "action_expert_variant": "tiny_expert", "chunk_size": CHUNK,
        "n_action_steps": CHUNK, "max_state_dim": MAX, "max_action_dim": MAX, "num_inference_steps": 3,
        "image_resolution": [28, 28], "tokenizer_max_length": 48 if kind == "pi0" else 128,
        "device": "cpu", "use_amp": False, "rtc_config": None, "compile_model": False,
        "gradient_checkpointing": False, "freeze_vision_encoder": False, "train_expert_only": False})
    return base


def write_processors(path: Path, config: dict, stats: dict) -> None:
    """policy_preprocessor.json / policy_postprocessor.json and their statistics files, laid out as
    LeRobot's make_pi0(5)_pre_post_processors + save_pretrained write them."""
    norm = {"eps": 1e-08, "features": {**config["input_features"], **config["output_features"]},
            "norm_map": config["normalization_mapping"]}
    tokenizer = {"registry_name": "tokenizer_processor",
                 "config": {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                            "padding": "max_length", "truncation": True, "tokenizer_name": "tokenizer"}}
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    head = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}}]
    if config["type"] == "pi0":
        at = 5
        steps = head + [{"registry_name": "pi0_new_line_processor", "config": {}}, tokenizer, device]
        steps.append({"registry_name": "normalizer_processor", "config": norm,
                      "state_file": f"policy_preprocessor_step_{at}_normalizer_processor.safetensors"})
    else:
        at = 2
        steps = head + [{"registry_name": "normalizer_processor", "config": norm,
                         "state_file": f"policy_preprocessor_step_{at}_normalizer_processor.safetensors"},
                        {"registry_name": "pi05_prepare_state_tokenizer_processor_step",
                         "config": {"max_state_dim": MAX, "task_key": "task"}}, tokenizer, device]
    flat = {f"{feature}.{stat}": t.contiguous() for feature, d in stats.items() for stat, t in d.items()}
    save_file(flat, str(path / f"policy_preprocessor_step_{at}_normalizer_processor.safetensors"))
    (path / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}, indent=4))
    post = [{"registry_name": "unnormalizer_processor",
             "config": {**norm, "features": config["output_features"]},
             "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"}, device]
    save_file({k: v for k, v in flat.items() if k.startswith("action.")},
              str(path / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    (path / "policy_postprocessor.json").write_text(json.dumps({"name": "policy_postprocessor", "steps": post}, indent=2))


def write_dir(path: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random-init LeRobot π0 / π0.5 directory: every tensor N(0, 0.1) (none left at an
    initialiser's zeros or ones), model.safetensors as LeRobot's files hold it."""
    path.mkdir(parents=True)
    config = lerobot_config(kind)
    (path / "config.json").write_text(json.dumps(config, indent=4))
    spec = pi0_spec.PI0Spec.from_config(config, "test")
    with torch.random.fork_rng(devices=[]):
        net = PI0Net(spec)
    g = torch.Generator().manual_seed(seed)
    tensors = {"model." + k: (0.1 * torch.randn(v.shape, generator=g)).contiguous() for k, v in net.state_dict().items()
               if k not in TIED.values()}
    save_file(tensors, str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    stats = {}
    for feature, size in (("observation.state", STATE), ("action", ACTION)):
        lo = torch.randn(size, generator=g)
        stats[feature] = {"mean": torch.randn(size, generator=g), "std": 0.5 + torch.rand(size, generator=g),
                          "min": lo - 2, "max": lo + 2, "q01": lo - 1, "q99": lo + 1.5}
    write_processors(path, config, stats)
    build_tokenizer(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0")
    return {kind: write_dir(root / kind, kind) for kind in ("pi0", "pi05")}


@pytest.fixture(scope="module")
def loaded(dirs):
    return {kind: PI0.load(path) for kind, path in dirs.items()}


def observation(b: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    frames = {k: rng.integers(0, 256, (b, 40, 32, 3), dtype=np.uint8) for k in CAMERAS}  # (resized and padded)
    state = rng.normal(size=(b, STATE)).astype(np.float32)
    noise = torch.from_numpy(rng.normal(size=(b, CHUNK, MAX)).astype(np.float32))
    return frames, state, noise


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------------- the published shape
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_published_shape_has_lerobots_names_shapes_and_counts(kind):
    golden = json.loads((GOLDEN / f"{kind}_params.json").read_text())
    assert golden["config"] == released.RELEASED[kind] and golden["versions"]["lerobot"] == "0.4.3"
    net = released.released_net(kind)
    assert all(p.is_meta for p in net.parameters())
    named = sorted([k, list(p.shape)] for k, p in net.named_parameters())
    assert len(named) == golden["tensors"]
    missing = [x for x in golden["parameters"] if x not in named]
    extra = [x for x in named if x not in golden["parameters"]]
    assert not missing and not extra, (missing[:3], extra[:3])
    assert named == golden["parameters"]
    assert released.parameter_counts(net.named_parameters()) == golden["counts"]
    tied = {k: n for k, n in TIED.items()}
    assert golden["tied"] == tied and golden["lm_head_tied_to_embed_tokens"]
    pg = net.paligemma_with_expert.paligemma
    assert pg.lm_head.weight is pg.model.language_model.embed_tokens.weight


def test_published_counts():
    """π0 3.50 B parameters (2.51 B Gemma 2B, 412 M SigLIP, 311 M expert, 263 M the expert's unused
    lm_head that LeRobot's files carry); π0.5 3.62 B (adaRMS adds 116 M, no state projection)."""
    pi0 = json.loads((GOLDEN / "pi0_params.json").read_text())["counts"]
    pi05 = json.loads((GOLDEN / "pi05_params.json").read_text())["counts"]
    assert pi0["total"] == 3_501_372_176 and pi05["total"] == 3_616_757_520
    assert pi0["language_model"] == pi05["language_model"] == 2_508_531_712
    assert pi0["vision_tower"] == pi05["vision_tower"] == 412_442_352
    assert pi0["gemma_expert"] == 311_464_960 and pi05["gemma_expert"] == 427_932_672
    assert pi05["gemma_expert"] - pi0["gemma_expert"] == 37 * (3 * 1024 * 1024 + 3 * 1024) - 37 * 1024
    spec = released.released_net("pi0").spec
    assert (spec.paligemma.width, spec.paligemma.depth, spec.paligemma.mlp_dim, spec.paligemma.num_heads,
            spec.paligemma.num_kv_heads, spec.paligemma.head_dim, spec.paligemma.vocab_size) == (
        2048, 18, 16_384, 8, 1, 256, 257_152)
    assert (spec.expert.width, spec.expert.depth, spec.expert.mlp_dim) == (1024, 18, 4096)
    assert (spec.chunk_size, spec.max_state_dim, spec.max_action_dim, spec.image_resolution) == (50, 32, 32, (224, 224))


def test_published_shape_acts_on_the_meta_device():
    """The whole sample() at π0's shape on tensors without data (one camera, 12 tokens, 10 steps)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    net = released.released_net("pi0")
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("meta"):
        chunk = net.sample([torch.zeros(1, 3, 224, 224)], [torch.ones(1, dtype=torch.bool)],
                           torch.zeros(1, 12, dtype=torch.long), torch.ones(1, 12, dtype=torch.bool),
                           torch.zeros(1, 32), torch.zeros(1, 50, 32))
    assert tuple(chunk.shape) == (1, 50, 32) and chunk.dtype == torch.float32


# --------------------------------------------------------------------------------- loading and acting
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_loads_and_acts(loaded, kind):
    vla = loaded[kind]
    assert vla.spec.type == kind and vla.spec.pi05 == (kind == "pi05")
    frames, state, noise = observation()
    ids, mask = vla.tokenize(TASKS, state)
    assert ids.shape == (2, vla.spec.tokenizer_max_length) and mask[:, 0].all() and not mask[:, -1].any()
    assert (ids[:, 0] == vla.tokenizer.convert_tokens_to_ids("<bos>")).all()
    a = vla.act_chunk(frames, state, ids, mask, noise)
    assert a.shape == (2, CHUNK, ACTION) and a.dtype == np.float32 and np.isfinite(a).all()
    assert np.array_equal(a, vla.act_chunk(frames, state, ids, mask, noise))
    other_noise = vla.act_chunk(frames, state, ids, mask, noise + 0.5)
    assert np.abs(other_noise - a).max() > 1e-3
    other_frames = dict(frames, **{CAMERAS[0]: 255 - frames[CAMERAS[0]]})
    assert np.abs(vla.act_chunk(other_frames, state, ids, mask, noise) - a).max() > 1e-3
    rows = vla.act_chunk({k: v[1:] for k, v in frames.items()}, state[1:], ids[1:], mask[1:], noise[1:])
    np.testing.assert_allclose(rows, a[1:], rtol=1e-4, atol=1e-5)     # (rows do not mix)


def test_state_reaches_pi0_by_its_token_and_pi05_by_its_prompt(loaded):
    frames, state, noise = observation()
    pi0, pi05 = loaded["pi0"], loaded["pi05"]
    ids, mask = pi0.tokenize(TASKS)
    moved = state + 3.0
    assert np.abs(pi0.act_chunk(frames, moved, ids, mask, noise) - pi0.act_chunk(frames, state, ids, mask, noise)).max() > 1e-3
    prompts = pi05.prompts(TASKS, state)
    assert prompts[1].startswith("Task: pick up the red block, State: ") and prompts[1].endswith(";\nAction: ")
    normed = pi05.normalized_state(state).numpy()          # QUANTILES onto [-1, 1], padded to MAX
    expect = " ".join(str(int(v)) for v in np.digitize(normed[0], np.linspace(-1, 1, 257)[:-1]) - 1)
    assert prompts[0] == f"Task: push the cube to the goal, State: {expect};\nAction: "
    assert prompts[0].endswith(" 128 128 128;\nAction: ")   # (the zero padding: bin 128)
    ids, mask = pi05.tokenize(TASKS, state)
    ids2, mask2 = pi05.tokenize(TASKS, moved)
    assert not np.array_equal(ids, ids2)
    assert np.array_equal(pi05.act_chunk(frames, state, ids, mask, noise), pi05.act_chunk(frames, moved, ids, mask, noise))


def reference_velocity(net: PI0Net, images, image_masks, ids, mask, state, x_t, t):
    """LeRobot's other path to the velocity (PI0Pytorch.forward's compute_layer_complete): prefix and
    suffix in one pass, each layer's queries, keys and values of both models concatenated and
    attending together under one mask, no cache."""
    pre, pre_pad = net.embed_prefix(images, image_masks, ids, mask)
    suf, blocks, cond = net.embed_suffix(state, x_t, t)
    b = pre.shape[0]
    pad = torch.cat([pre_pad, torch.ones(b, suf.shape[1], dtype=torch.bool)], dim=1)
    att = torch.tensor([0] * pre.shape[1] + blocks)[None].expand(b, -1)
    allowed = attention_mask(pad, att)
    positions = torch.cumsum(pad.long(), dim=1) - 1
    models = [net.paligemma_with_expert.language_model, net.paligemma_with_expert.expert]
    hs, conds = [pre, suf], [None, cond]
    for i in range(len(models[0].layers)):
        layers = [m.layers[i] for m in models]
        normed = [rms_norm(layer.input_layernorm, h, c) for layer, h, c in zip(layers, hs, conds)]
        qkv = [net._qkv(layer.self_attn, x, positions[:, :pre.shape[1]] if j == 0 else positions[:, pre.shape[1]:])
               for j, (layer, (x, _)) in enumerate(zip(layers, normed))]
        out = attention(*(torch.cat([p[n] for p in qkv], dim=2) for n in range(3)), allowed)
        new = []
        for j, (layer, h, (_, gate)) in enumerate(zip(layers, hs, normed)):
            piece = out[:, :pre.shape[1]] if j == 0 else out[:, pre.shape[1]:]
            h = residual(h, layer.self_attn.o_proj(piece), gate)
            x, gate2 = rms_norm(layer.post_attention_layernorm, h, conds[j])
            new.append(residual(h, layer.mlp(x), gate2))
        hs = new
    h, _ = rms_norm(models[1].norm, hs[1], cond)
    return net.action_out_proj(h[:, -net.spec.chunk_size:])


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_cached_prefix_gives_the_joint_passs_velocity(loaded, kind):
    """The prefix's keys and values computed once and reused at every step give the velocity of one
    joint pass over prefix and suffix, at several times; the Euler loop integrates it from t = 1
    (the noise) to t = 0 in num_inference_steps steps of -1/num_inference_steps."""
    vla = loaded[kind]
    frames, state, noise = observation()
    ids, mask = vla.tokenize(TASKS, state)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    mask[0, 4:] = False                                    # (a shorter instruction in row 0)
    pixels, present = vla.images(frames)
    s = vla.normalized_state(state)
    with torch.no_grad():
        cache, pad = vla.net.prefix(pixels, present, ids, mask)
        for time in (1.0, 0.37):
            t = torch.full((2,), time)
            v = vla.net.velocity(cache, pad, s, noise, t)
            ref = reference_velocity(vla.net, pixels, present, ids, mask, s, noise, t)
            torch.testing.assert_close(v, ref, rtol=1e-4, atol=1e-5)
        x, n = noise.clone(), vla.spec.num_inference_steps
        for step in range(n):
            x = x + (-1.0 / n) * vla.net.velocity(cache, pad, s, x, torch.full((2,), 1.0 - step / n))
        torch.testing.assert_close(vla.net.sample(pixels, present, ids, mask, s, noise), x)


def test_time_features_are_lerobots_sine_cosine():
    t = torch.tensor([1.0, 0.25])
    f = time_features(t, 8, 4e-3, 4.0)
    period = 4e-3 * (4.0 / 4e-3) ** (torch.arange(4, dtype=torch.float64) / 3)
    angle = 2 * math.pi / period[None] * t.double()[:, None]
    torch.testing.assert_close(f, torch.cat([angle.sin(), angle.cos()], 1).float())


def test_a_missing_camera_is_masked_and_the_resize_pads_as_lerobot(loaded):
    vla = loaded["pi0"]
    frames, _, _ = observation()
    pixels, present = vla.images({CAMERAS[1]: frames[CAMERAS[1]]})
    assert [m.tolist() for m in present] == [[True, True], [False, False]]
    assert (pixels[1] == -1).all()
    # 40 x 32 -> 28 x 22, padded 3 columns left and right with -1 before x * 2 - 1 (so -3, as LeRobot)
    assert pixels[0].shape == (2, 3, 28, 28)
    assert (pixels[0][..., :3] == -3).all() and (pixels[0][..., 25:] == -3).all()
    assert pixels[0][..., 3:25].min() >= -1


# --------------------------------------------------------------------------------- refusals
def rewrite(path: Path, change) -> None:
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_tied_embedding_loads_from_either_name(tmp_path):
    path = write_dir(tmp_path / "d", "pi0", seed=3)
    base = PI0.load(path)
    lm_head, embed = ("model." + k for k in (*TIED, *TIED.values()))

    def swap(t):
        t[embed] = t.pop(lm_head)
    rewrite(path, swap)
    again = PI0.load(path)
    frames, state, noise = observation()
    ids, mask = base.tokenize(TASKS, state)
    assert np.array_equal(base.act_chunk(frames, state, ids, mask, noise), again.act_chunk(frames, state, ids, mask, noise))


@pytest.mark.parametrize("case, match", [
    ("missing", r"1 missing \(model\.paligemma_with_expert\.gemma_expert\.model\.layers\.1\.mlp\.up_proj\.weight\)"),
    ("unexpected", r"1 unexpected \(model\.paligemma_with_expert\.gemma_expert\.model\.layers\.1\.input_layernorm\.dense\.weight\)"),
    ("shape", r"tensor model\.action_out_proj\.weight has shape \[7, 24\]; its config gives \[8, 24\]"),
    ("renamed", r"1 missing \(model\.state_proj\.weight\); 1 unexpected \(model\.state_projection\.weight\)"),
], ids=["missing", "unexpected", "shape", "renamed"])
def test_tensor_refusals_are_one_line_naming_the_tensor(tmp_path, case, match):
    path = write_dir(tmp_path / "d", "pi0", seed=4)
    prefix = "model.paligemma_with_expert.gemma_expert.model.layers.1."
    change = {
        "missing": lambda t: t.pop(prefix + "mlp.up_proj.weight"),
        "unexpected": lambda t: t.update({prefix + "input_layernorm.dense.weight": torch.zeros(72, 24)}),
        "shape": lambda t: t.update({"model.action_out_proj.weight": torch.zeros(7, 24)}),
        "renamed": lambda t: t.update({"model.state_projection.weight": t.pop("model.state_proj.weight")}),
    }[case]
    rewrite(path, change)
    with pytest.raises(LeRobotDirError, match=match) as e:
        PI0.load(path)
    assert str(path / "model.safetensors") in one_line(e)
    lines = kinds.preflight(PolicyConfig(pretrained_path=str(path)))
    assert len(lines) == 2 and str(path / "model.safetensors") in lines[0]


def test_config_and_statistics_refusals_are_one_line(tmp_path):
    path = write_dir(tmp_path / "d", "pi05", seed=5)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "type": "pi1"}))
    with pytest.raises(LeRobotDirError, match=r"\"type\": 'pi1' is a LeRobot policy asyncvla cannot load; "
                                              r"supported: \['smolvla', 'pi0', 'pi05'\]") as e:
        PI0.load(path)
    one_line(e)
    with pytest.raises(LeRobotDirError, match="cannot load"):
        kinds.kind_of(path)
    (path / "config.json").write_text(json.dumps({**config, "type": "smolvla"}))
    with pytest.raises(LeRobotDirError, match=r"'smolvla' is not a pi0 / pi05 policy"):
        PI0.load(path)
    (path / "config.json").write_text(json.dumps({**config, "paligemma_variant": "gemma_7b"}))
    with pytest.raises(LeRobotDirError, match=r"paligemma_variant='gemma_7b'; known: \["):
        PI0.load(path)
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file
    for stats in path.glob("*normalizer_processor.safetensors"):     # (pi05: QUANTILES; q99 dropped)
        save_file({k: v for k, v in load_file(str(stats)).items() if k != "action.q99"}, str(stats))
    with pytest.raises(LeRobotDirError, match=r"no normaliser statistic action\.q99 \(its normalisation is "
                                              r"QUANTILES\)") as e:
        PI0.load(path)
    one_line(e)
    lines = kinds.preflight(PolicyConfig(pretrained_path=str(path)))
    assert len(lines) == 2 and "action.q99" in lines[0] and "RL on them is not supported yet" in lines[1]


def test_registered_as_a_kind_that_loads_and_refuses_rl(dirs):
    for kind, path in dirs.items():
        assert kinds.kind_of(path) == "pi0"
        assert kinds.starts_trained(path)
        cfg = PolicyConfig(pretrained_path=str(path))
        assert kinds.preflight(cfg) == [
            f"policy.pretrained_path={str(path)!r}: π0/π0.5 directories load and act "
            "(asyncvla.common.policy.pi0.PI0) but RL on them is not supported yet"]
        with pytest.raises(LeRobotDirError, match="RL on them is not supported yet") as e:
            kinds.build_policy(cfg)
        one_line(e)
        with pytest.raises(LeRobotDirError, match="RL on them is not supported yet"):
            kinds.load_policy(path)
