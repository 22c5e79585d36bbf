"""Backbone families (common/policy/families/): Idefics3/SmolVLM, PaliGemma and Qwen2.5-VL, each as a
tiny random-init checkpoint written with save_pretrained and loaded the way a downloaded one is
(policy.pretrained_path): act/evaluate agreement bit for bit with both action heads, LoRA on the
documented targets only, Qwen2.5-VL's pixels and positions against its own processor and
get_rope_index, a directory of another architecture refused in one line; then, per family, a real
`asyncvla train` (ZeRO-3 on 2 learner ranks, 2 actors) whose checkpoint is exported, loaded and
acts as the checkpoint does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncvla.common.config import load_config
from asyncvla.common.policy import VLAPolicy
from asyncvla.common.policy.backbone import write_tiny_backbone
from asyncvla.common.policy.families import FAMILY_NAMES, family_by_name
from asyncvla.common.policy.families.released import RELEASED, build_on_meta, lora_trainable, parameter_count
from tests.support.paths import PIXEL, REPO
from tests.support.ports import run_port_overrides

INSTRUCTIONS = ["push the cube to the goal region", "lift the peg", ""]


def tiny_dir(tmp_path: Path, family: str) -> Path:
    """A tiny checkpoint of `family` with the pixel task's backbone sizes, as on disk after a download."""
    cfg = load_config(str(PIXEL), [f"policy.backbone.family={family}"]).policy
    return Path(write_tiny_backbone(str(tmp_path / family), cfg.backbone, cfg.image_size, cfg.n_bins, seed=3))


def policy_from(path: Path, *overrides: str) -> VLAPolicy:
    cfg = load_config(str(PIXEL), [f"policy.pretrained_path={path}", "policy.state_dim=0", *overrides]).policy
    policy = VLAPolicy.build(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():       # LoRA-B starts at 0 (the adapter would do nothing): give it values
        for name, p in policy.named_parameters():
            if ".lora_B" in name or name.startswith(("value_head.", "action_queries.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


def observation(policy: VLAPolicy, batch: int = 3):
    rng = np.random.default_rng(0)
    size = policy.cfg.image_size
    image = rng.integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
    ids, mask = policy.tokenize([INSTRUCTIONS[i % 3] for i in range(batch)])
    return image, ids, mask


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: tiny_dir(root, f) for f in FAMILY_NAMES}


@pytest.mark.parametrize("head", ["autoregressive", "parallel"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_act_and_evaluate_agree_bit_for_bit(dirs, family, head):
    policy = policy_from(dirs[family], f"policy.action_head={head}")
    assert policy.family.name == family
    image, ids, mask = observation(policy)
    out = policy.act(image, ids, mask, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ev = policy.evaluate(image, ids, mask, None, out.replay)
    assert np.array_equal(ev.logprobs.numpy(), out.logprobs) and np.array_equal(ev.values.numpy(), out.values)
    first = policy.action_tokenizer.first_id
    assert first == policy.action_tokenizer.vocab_size - policy.cfg.n_bins        # the vocabulary's last ids
    assert out.replay["action_tokens"].min() >= first


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_paligemma_s_prompt_attends_both_ways_the_others_causally(dirs, family):
    """A later instruction changes the hidden state of the first image token only in a prefix LM."""
    policy = policy_from(dirs[family])
    image, _, _ = observation(policy, batch=2)
    ids, mask = policy.tokenize(["push the cube to the goal region", "lift the peg"])
    first = []
    for row in (0, 1):
        inputs = policy._inputs(image[:1], ids[row:row + 1], mask[row:row + 1], None)
        embeds, attn, pos, _ = policy._prompt(*inputs)
        with torch.no_grad():
            hidden = policy.decode(embeds, policy.prompt_mask(attn, embeds.dtype), pos, None, False).last_hidden_state
        first.append(hidden[0, policy.layout.image_start])
    assert torch.equal(first[0], first[1]) == (family != "paligemma")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_lora_sits_on_the_documented_targets_only(dirs, family):
    """The family's targets (its language model's q, k, v, o projections, every layer), nothing else;
    r x (in + out) trainable numbers each, plus the value head."""
    from asyncvla.common.policy.backbone import load_backbone

    policy = policy_from(dirs[family], "policy.is_lora=true")
    vlm, _, _ = load_backbone(str(dirs[family]), torch.float32)
    targets = re.compile(family_by_name(family).lora_targets)
    expected = {n: m for n, m in vlm.named_modules() if targets.fullmatch(n) and isinstance(m, torch.nn.Linear)}
    assert len(expected) == 4 * policy.cfg.backbone.text_layers, sorted(expected)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    adapted = {n.removeprefix("backbone.base_model.model.").split(".lora_")[0] for n in trainable if ".lora_" in n}
    assert adapted == set(expected)
    assert all(n.startswith("value_head.") for n in trainable if ".lora_" not in n)
    r = policy.cfg.lora_rank
    lora = sum(p.numel() for n, p in trainable.items() if ".lora_" in n)
    assert lora == sum(r * (m.in_features + m.out_features) for m in expected.values())


def test_qwen_pixels_are_the_processor_s(dirs):
    """Normalised and flattened as Qwen2VLImageProcessor does for an image already at the side."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from asyncvla.common.policy.families.qwen2_5_vl import patchify
    policy = policy_from(dirs["qwen2_5_vl"])
    side = policy.image_spec.model_size
    image = np.random.default_rng(1).integers(0, 256, (2, side, side, 3), dtype=np.uint8)
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(dirs["qwen2_5_vl"]))
    ref = processor(images=list(image), return_tensors="pt")
    vc = policy._vlm.config.vision_config
    mine, grid = patchify(policy._pixels(torch.as_tensor(image)), vc.patch_size, vc.temporal_patch_size,
                          vc.spatial_merge_size)
    assert torch.equal(grid, ref["image_grid_thw"])
    assert torch.allclose(mine, ref["pixel_values"], atol=1e-5)


def test_qwen_positions_are_get_rope_index_s(dirs):
    policy = policy_from(dirs["qwen2_5_vl"], "policy.state_dim=0")
    image, ids, mask = observation(policy)
    inputs = policy._inputs(image, ids, mask, None)
    _, attn, pos, _ = policy._prompt(*inputs)
    lay, b, ids_t = policy.layout, ids.shape[0], inputs[1]
    full = torch.cat([torch.tensor(lay.fixed_ids).expand(b, -1), ids_t], 1)
    vc = policy._vlm.config.vision_config
    cells = policy.image_spec.model_size // vc.patch_size
    types = (full == policy._vlm.config.image_token_id).int()
    ref, _ = policy._vlm.model.get_rope_index(full, types, image_grid_thw=torch.tensor([[1, cells, cells]] * b),
                                               attention_mask=attn)
    if ref.shape[0] == 4:                                             # (text positions first, then t, h, w)
        ref = ref[1:]
    keep = attn.bool()
    assert torch.equal(pos[:, keep], ref[:, keep])


def test_a_directory_of_another_architecture_is_refused_in_one_line(tmp_path):
    from transformers import BertConfig, BertModel

    from asyncvla.launch.preflight import problems
    path = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                         vocab_size=99)).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    cfg = load_config(str(PIXEL), [f"policy.pretrained_path={path}"])
    found = problems(cfg, ports=False)
    assert found == [f"policy.pretrained_path='{path}': holds a 'bert' model; supported: idefics3, smolvlm, "
                     "paligemma, qwen2_5_vl (common/policy/families/) or a policy saved by asyncvla"], found
    with pytest.raises(ValueError, match="holds a 'bert' model; supported: idefics3, smolvlm, paligemma, qwen2_5_vl"):
        VLAPolicy.build(cfg.policy)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_train_with_zero3_on_2_ranks_then_export_acts_as_the_checkpoint(tmp_path, family):
    from asyncvla.learner.export import export_policy, load_checkpoint

    path = tiny_dir(tmp_path, family)
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", str(PIXEL),
                        f"policy.pretrained_path={path}", "policy.is_lora=true", "launch.num_learner_ranks=2", "launch.num_local_actors=2",
                        "learner.max_steps=2", "learner.batch_trajectories=8", "actor.num_envs=4",
                        "actor.rollout_length=4", "algorithm.update_epochs=1", "algorithm.num_minibatches=1",
                        "learner.micro_batch_size=16", "eval.eval_interval=0", "checkpoint.save_interval=2",
                        f"logging.output_dir={tmp_path}", "logging.experiment_name=run", "logging.progress=false",
                        *run_port_overrides()], cwd=REPO, capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "finished at step 2" in out, out[-4000:]
    run = tmp_path / "run"
    export_policy(run, tmp_path / "exported")
    exported = VLAPolicy.from_pretrained(str(tmp_path / "exported"))
    trained, _, _ = load_checkpoint(run)
    assert exported.family.name == family
    image, ids, mask = observation(exported, batch=4)
    state = np.zeros((4, exported.cfg.state_dim), np.float32) if exported.cfg.state_dim else None
    a = exported.act(image, ids, mask, state, greedy=True)
    b = trained.act(image, ids, mask, state, greedy=True)
    assert np.array_equal(a.replay["action_tokens"], b.replay["action_tokens"])
    assert np.allclose(a.logprobs, b.logprobs, atol=1e-4) and np.allclose(a.values, b.values, atol=1e-4)


@pytest.mark.parametrize("name", [r.name for r in RELEASED])
def test_released_checkpoints_built_on_meta_have_their_published_sizes(name):
    """Each family's released checkpoints (families/released.py: their config.json) built with no
    weights: parameters within 1 % of the published count; LoRA r32 on the documented targets adds
    rank x (in + out) per q, k, v, o projection of every language-model layer, counted from the
    config's own dimensions."""
    released = next(r for r in RELEASED if r.name == name)
    model = build_on_meta(released)
    assert abs(parameter_count(model) / released.published_params - 1) < 0.01
    text = model.config.text_config
    h, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    hd = getattr(text, "head_dim", None) or h // heads
    per_layer = (h + heads * hd) + 2 * (h + kv * hd) + (heads * hd + h)       # q, k, v, o: in + out
    assert lora_trainable(model, family_by_name(released.family).lora_targets, 32) == \
        32 * per_layer * text.num_hidden_layers


@pytest.mark.parametrize("config, family", [("maniskill_gpu.yaml", "idefics3"), ("paligemma_gpu.yaml", "paligemma"),
                                            ("qwen2_5_vl_gpu.yaml", "qwen2_5_vl")])
def test_each_family_s_gpu_config_takes_a_checkpoint_of_the_family(dirs, config, family):
    """The GPU configs (bf16, LoRA r32 on the family's targets, ZeRO-3) accept a directory of their
    family; without one they say which key to set."""
    from asyncvla.launch.preflight import problems
    cfg = load_config(str(REPO / "configs" / config), [f"policy.pretrained_path={dirs[family]}"])
    assert problems(cfg, ports=False) == []
    assert cfg.policy.is_lora and cfg.policy.lora_rank == 32 and cfg.learner.zero_stage == 3
    if family != "idefics3":
        assert cfg.policy.precision == "bf16" and cfg.policy.lora_target_modules == "auto"
        missing = load_config(str(REPO / "configs" / config))
        assert problems(missing, ports=False)[0].startswith("policy.pretrained_path=") and \
            "no such directory" in problems(missing, ports=False)[0]
