"""SmolVLA at its published shape (lerobot/smolvla_base: SmolVLM2-500M cut to 16 layers, an expert
0.75 as wide, chunk 50), built on the meta device from common/policy/smolvla/released.py: its
parameters are LeRobot's, in number (in all and per part) and by name and shape, as LeRobot 0.4.3
counted them on the meta device from the same configs (tests/golden/smolvla/smolvla_base_params.json,
written by tests/interop/smolvla_side.py count). Seconds: no weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from asyncvla.common.policy.families.released import SMOLVLM_500M_INSTRUCT
from asyncvla.common.policy.smolvla import released

LEROBOT = json.loads((Path(__file__).parent / "golden" / "smolvla" / "smolvla_base_params.json").read_text())


@pytest.fixture(scope="module")
def net():
    return released.smolvla_base_net()


def test_lerobot_counted_the_configs_released_py_holds():
    assert LEROBOT["vlm_config"] == released.SMOLVLM2_500M_VIDEO_INSTRUCT
    assert LEROBOT["smolvla_config"] == released.SMOLVLA_BASE
    assert LEROBOT["versions"]["lerobot"] == "0.4.3"


def test_parameter_count_equals_lerobots_in_all_and_per_part(net):
    assert all(p.is_meta for p in net.parameters())
    assert released.parameter_counts(net) == LEROBOT["parameters"]
    assert LEROBOT["parameters"]["total"] == 450_046_176          # SmolVLA's "450M"


def test_every_parameter_has_lerobots_name_and_shape(net):
    """So smolvla_base's model.safetensors would load by name (SmolVLANet.load_weights)."""
    named = sorted((k, list(p.shape)) for k, p in net.named_parameters())
    assert len(named) == LEROBOT["tensors"]
    lines = "".join(f"{k} {shape}\n" for k, shape in named)
    assert hashlib.sha256(lines.encode()).hexdigest() == LEROBOT["parameter_names_sha256"]


def test_the_vlm_has_smolvlm_500ms_shape_and_published_count():
    """SmolVLM2-500M shares SmolVLM-500M-Instruct's text and vision shapes: the full VLM (32 layers,
    before SmolVLA cuts it) has the latter's published count."""
    vlm, other = released.SMOLVLM2_500M_VIDEO_INSTRUCT, SMOLVLM_500M_INSTRUCT.config
    for key in ("image_token_id", "scale_factor", "tie_word_embeddings", "vocab_size"):
        assert vlm[key] == other[key], key
    assert vlm["text_config"] == other["text_config"]
    assert {k: v for k, v in vlm["vision_config"].items() if k != "model_type"} == other["vision_config"]
    from transformers import AutoModelForImageTextToText
    with torch.device("meta"):
        full = AutoModelForImageTextToText.from_config(released.vlm_config())
    assert sum(p.numel() for p in full.parameters()) == SMOLVLM_500M_INSTRUCT.published_params


def test_act_runs_at_this_shape_on_the_meta_device(net):
    """The whole act() (the prefix pass and 10 denoising steps) at this shape, on tensors without
    data: one 512 x 512 camera, a 12-token instruction, the state -> a chunk of 50 x 32. Under a
    FakeTensorMode, as transformers' SigLIP asks whether its mask is all ones (data a meta tensor
    does not have) unless it is traced; tests/benchmarks/smolvla_act.py runs it with weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    spec = net.spec
    w, h = spec.resize_imgs_with_padding
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("meta"):
        chunk = net.sample([torch.zeros(1, 3, h, w)], [torch.ones(1, dtype=torch.bool)],
                           torch.zeros(1, 12, dtype=torch.long), torch.ones(1, 12, dtype=torch.bool),
                           torch.zeros(1, spec.max_state_dim), torch.zeros(1, spec.chunk_size, spec.max_action_dim))
    assert tuple(chunk.shape) == (1, 50, 32) and chunk.dtype == torch.float32 and spec.num_steps == 10
