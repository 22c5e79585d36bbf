"""Golden SmolVLA fixtures written by LeRobot 0.4.3 itself, for checking asyncvla's own SmolVLA
without LeRobot installed. Runs in the interop environment only (`make interop-env`), offline:

    HF_HUB_OFFLINE=1 .venv-interop/bin/python tests/interop/smolvla_side.py OUT_DIR

OUT_DIR (tests/golden/smolvla) then holds:

    vlm/              a tiny SmolVLM (SmolVLMForConditionalGeneration, bf16 weights) and its
                      SmolVLMProcessor (tokenizer trained here on a few sentences), shared by both
                      policies. It is built offline from a config; nothing is downloaded.
    tiny_a/policy/    a SmolVLA policy directory as LeRobot writes it: config.json, model.safetensors,
    tiny_b/policy/    policy_preprocessor.json / policy_postprocessor.json and the normaliser stats.
    tiny_?/io.npz     inputs, fixed noise, LeRobot's outputs and intermediates of two calls (c1, c2)
    tiny_?/io.json    what the keys of io.npz are, the configuration, the library versions.

A second command counts the parameters of SmolVLA at its published shape (lerobot/smolvla_base):

    HF_HUB_OFFLINE=1 .venv-interop/bin/python tests/interop/smolvla_side.py count OUT.json

LeRobot's SmolVLAPolicy built on the meta device (no storage, no weights) from the two config.json
files common/policy/smolvla/released.py writes out (SmolVLM2-500M-Video-Instruct's and
smolvla_base's, read from that file, nothing else of ours). `vlm_model_name` is a temporary
directory holding that VLM config.json and the processor and tokenizer files of the tiny VLM in
tests/golden/smolvla/vlm (LeRobot reads only the image special tokens' ids from its tokenizer,
which the count does not depend on). OUT.json (tests/golden/smolvla/smolvla_base_params.json) holds
the count, in all and by part, a digest of every parameter's name and shape, the configs and the
library versions.

The VLM path inside the policy files (config.json `vlm_model_name` and the tokenizer step's
`tokenizer_name` in policy_preprocessor.json) is the relative path "./vlm": it resolves with OUT_DIR
as the working directory (this script reloads the policy that way, and every golden output is
computed by the policy *as reloaded from the written files*). A consumer elsewhere either chdirs to
OUT_DIR or overrides both fields with the absolute path of OUT_DIR/vlm.

Every weight is random (seeded) plus N(0, 0.02) noise, so that no parameter is left at LeRobot's or
transformers' zero/one initialisation. Two runs write byte-identical files.

The float32 references (fp32.* keys) differ from LeRobot's float32 run in one place, on purpose:
SigLIP's patch positions. transformers 4.57 computes them in the pixels' dtype, and in float32 a
rounding (i / n * (1 - 1e-6) lands below its bucket's boundary) shifts them ([0, 0, 1, 2] per side
instead of [0, 1, 2, 3]). In bfloat16, the dtype LeRobot loads the VLM in and trains it in, the
rounding does not happen, and transformers 5 computes raster positions in every dtype. So the
float32 run here takes the raster positions (`raster_patch_positions`), the ones the weights of a
real SmolVLA were trained with; everything else is LeRobot's code as it is.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

VLM_REL = "./vlm"
PERTURB_STD = 0.02
BATCH = 2

# Text the tokenizer is trained on; the task strings below are built from its words.
CORPUS = [
    "push the cube to the goal\n",
    "pick up the red cube and place it on the green target\n",
    "move the arm to the left\n",
    "open the drawer and close it again\n",
    "stack the blue block on the red block\n",
    "push the red cube to the goal position\n",
    "place the cube on the target\n",
]
TASKS = {
    1: ["push the cube to the goal", "pick up the red cube and place it on the green target"],
    2: ["move the arm to the left", "stack the blue block on the red cube"],
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                  "<global-img>", "<end_of_utterance>"]
VOCAB_SIZE = 128

# The two policies. Config A: one square camera, PushCube-like sizes, LeRobot's defaults elsewhere
# (cross_attn, self-attn every 2nd layer, expert 0.75 wide, language padded to the longest).
# Config B: two cameras, one non-square (resize-with-pad) and one smaller (upsampled), image
# special tokens around each image, language padded to max_length, prefix padded to prefix_length,
# 3 VLM layers with a self-attention layer only every 3rd (0: self, 1-2: cross), expert 0.5 wide.
CONFIGS = {
    "tiny_a": dict(
        seed=1,
        cameras={"observation.images.cam": (3, 64, 64)},
        state_dim=9, action_dim=4,
        policy=dict(num_vlm_layers=2, chunk_size=8, n_action_steps=8, num_steps=4),
    ),
    "tiny_b": dict(
        seed=2,
        cameras={"observation.images.top": (3, 48, 80), "observation.images.wrist": (3, 32, 32)},
        state_dim=8, action_dim=7,
        policy=dict(num_vlm_layers=3, chunk_size=6, n_action_steps=6, num_steps=5,
                    self_attn_every_n_layers=3, expert_width_multiplier=0.5, add_image_special_tokens=True,
                    pad_language_to="max_length", tokenizer_max_length=20, prefix_length=48),
    ),
}
COMMON_POLICY = dict(load_vlm_weights=True, resize_imgs_with_padding=(64, 64), max_state_dim=16,
                     max_action_dim=16, device="cpu")


def perturb_(params, generator: torch.Generator) -> None:
    """Adds N(0, PERTURB_STD) to every parameter, in its own dtype (in place, in name order)."""
    with torch.no_grad():
        for _, p in sorted(params, key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * PERTURB_STD
            p.add_(noise.to(p.dtype))


def _sincos_positions(side: int, dim: int) -> torch.Tensor:
    """asyncvla's common/policy/positions.py, loaded by path: it needs torch only, and this
    environment does not install asyncvla."""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "common" / "policy" / "positions.py"
    spec = importlib.util.spec_from_file_location("asyncvla_positions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sincos_positions(side, dim)


def build_vlm(vlm_dir: Path, patch_size: int = 16, position_init: str = "random") -> None:
    """The tiny SmolVLM of the fixtures (64 px, patches of 16: 4 image tokens after the pixel
    shuffle); a smaller patch_size gives more image tokens ((64 / patch_size / 2) ** 2).
    position_init="sincos" sets the vision tower's patch positions to asyncvla's fixed 2-D pattern
    (common/policy/positions.py), as asyncvla's own tiny backbones: a VLM to train a policy on,
    where the random positions of the fixtures leave it slow to learn where things are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMForConditionalGeneration,
                              SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor)

    # Tokenizer: byte-level BPE (as SmolVLM's GPT-2 style tokenizer), no BOS/EOS added on encoding.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>", model_max_length=512,
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "global_image_token": "<global-img>",
                              "end_of_utterance_token": "<end_of_utterance>"})
    vocab = tokenizer.get_vocab()
    image_id, pad_id = vocab["<image>"], vocab["<|im_end|>"]

    config = SmolVLMConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=patch_size, image_size=64, num_channels=3),
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=64, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=512,
                         pad_token_id=pad_id, tie_word_embeddings=False),
        scale_factor=2, image_token_id=image_id, pad_token_id=pad_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = SmolVLMForConditionalGeneration(config).eval()
    perturb_(model.named_parameters(), torch.Generator().manual_seed(100))
    if position_init == "sincos":
        weight = model.model.vision_model.embeddings.position_embedding.weight     # [patches, width]
        with torch.no_grad():
            weight.copy_(_sincos_positions(round(weight.shape[0] ** 0.5), weight.shape[1]))
    elif position_init != "random":
        raise ValueError(f"position_init={position_init!r}: choose random or sincos")
    model = model.to(torch.bfloat16)
    model.save_pretrained(vlm_dir, safe_serialization=True)

    image_processor = SmolVLMImageProcessor(do_image_splitting=False, size={"longest_edge": 64},
                                            max_image_size={"longest_edge": 64}, do_resize=True)
    video_processor = SmolVLMVideoProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 64},
                                            do_image_splitting=False)
    processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, image_seq_len=(64 // patch_size // 2) ** 2)
    processor.save_pretrained(vlm_dir)


def make_inputs(cfg: dict, call: int, chunk: int, max_action_dim: int):
    """The observation (images: uint8 camera values / 255 in float32) and the noise of one call, and
    the images' uint8 values (what io.npz stores)."""
    g = torch.Generator().manual_seed(1000 * cfg["seed"] + call)
    obs, raw = {}, {}
    for key, shape in cfg["cameras"].items():
        raw[key] = torch.randint(0, 256, (BATCH, *shape), generator=g, dtype=torch.uint8)
        obs[key] = raw[key].to(torch.float32) / 255.0
    s = cfg["state_dim"]
    mean = torch.linspace(-0.5, 0.7, s)
    std = torch.linspace(0.3, 1.8, s)
    obs["observation.state"] = mean + std * torch.randn((BATCH, s), generator=g)
    obs["task"] = list(TASKS[call])
    noise = torch.randn((BATCH, chunk, max_action_dim), generator=g, dtype=torch.float32)
    return obs, noise, raw


def make_stats(cfg: dict) -> dict:
    s, a = cfg["state_dim"], cfg["action_dim"]
    stats = {
        "observation.state": {"mean": torch.linspace(-0.5, 0.7, s), "std": torch.linspace(0.3, 1.8, s)},
        "action": {"mean": torch.linspace(0.2, -0.4, a), "std": torch.linspace(0.05, 2.5, a)},
    }
    for v in stats.values():
        v["min"] = v["mean"] - 3 * v["std"]
        v["max"] = v["mean"] + 3 * v["std"]
    return stats


def f32(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.to(torch.float32)
    return t.numpy()


def run_calls(policy, pre, post, cfg: dict, full: bool) -> dict[str, np.ndarray]:
    """Two predict_action_chunk calls through LeRobot's own path, post(policy(pre(obs), noise)), with
    intermediates recorded by wrapping the policy's methods on the instance (the code is unchanged)."""
    out: dict[str, np.ndarray] = {}
    model, vwe = policy.model, policy.model.vlm_with_expert
    rec: dict = {}

    def wrap(obj, name, fn):
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            return fn(orig, *a, **k)
        setattr(obj, name, wrapped)
        return orig

    def prepare_images(orig, batch):
        images, masks = orig(batch)
        rec["images"], rec["img_masks"] = images, masks
        return images, masks

    def prepare_state(orig, batch):
        rec["state_padded"] = r = orig(batch)
        return r

    def embed_image(orig, img):
        r = orig(img)
        rec.setdefault("img_emb", []).append(r)
        return r

    def embed_prefix(orig, *a, **k):
        r = orig(*a, **k)
        rec["prefix"] = r
        return r

    def embed_suffix(orig, x_t, t):
        r = orig(x_t, t)
        rec.setdefault("suffix", []).append(r)
        return r

    def vwe_forward(orig, *a, **k):
        r = orig(*a, **k)
        if k.get("fill_kv_cache"):
            rec["kv"] = r[1]
            rec["prefix_out"] = r[0][0]
        return r

    def denoise_step(orig, *a, **k):
        v = orig(*a, **k)
        rec.setdefault("steps", []).append((k["x_t"], k["timestep"], v))
        return v

    originals = [(policy, "prepare_images", wrap(policy, "prepare_images", prepare_images)),
                 (policy, "prepare_state", wrap(policy, "prepare_state", prepare_state)),
                 (vwe, "embed_image", wrap(vwe, "embed_image", embed_image)),
                 (model, "embed_prefix", wrap(model, "embed_prefix", embed_prefix)),
                 (model, "embed_suffix", wrap(model, "embed_suffix", embed_suffix)),
                 (vwe, "forward", wrap(vwe, "forward", vwe_forward)),
                 (model, "denoise_step", wrap(model, "denoise_step", denoise_step))]
    try:
        for call in (1, 2):
            rec.clear()
            obs, noise, raw = make_inputs(cfg, call, policy.config.chunk_size, policy.config.max_action_dim)
            p = f"c{call}."
            if full:
                for k, v in obs.items():
                    out[p + "in." + k] = np.array(v) if k == "task" else raw[k].numpy() if k in raw else f32(v)
                out[p + "noise"] = f32(noise)
            batch = pre(copy.deepcopy(obs))
            actions_norm = policy.predict_action_chunk(batch, noise=noise.clone())
            actions = post(actions_norm)
            out[p + "actions"] = f32(actions)
            out[p + "actions_norm"] = f32(actions_norm)
            out[p + "x_final"] = f32(rec["steps"][-1][0] + (-1.0 / policy.config.num_steps) * rec["steps"][-1][2])
            out[p + "prefix_embs"] = f32(rec["prefix"][0])
            for i, (x_t, t, v) in enumerate(rec["steps"]):
                out[p + f"step{i}.x_t"] = f32(x_t)
                out[p + f"step{i}.time"] = f32(t)
                out[p + f"step{i}.v_t"] = f32(v)
            out[p + "step0.suffix_embs"] = f32(rec["suffix"][0][0])
            if full:
                out[p + "pre.observation.state"] = f32(batch["observation.state"])
                out[p + "pre.observation.language.tokens"] = f32(batch["observation.language.tokens"])
                out[p + "pre.observation.language.attention_mask"] = f32(batch["observation.language.attention_mask"])
                out[p + "state_padded"] = f32(rec["state_padded"])
                cams = list(policy.config.image_features)
                for i, (img, m) in enumerate(zip(rec["images"], rec["img_masks"], strict=True)):
                    # (size) kept for call 1 and only where resize_with_pad is not the identity
                    if call == 1 and tuple(img.shape[2:]) != tuple(obs[cams[i]].shape[2:]):
                        out[p + f"images.{i}"] = f32(img)
                    out[p + f"img_masks.{i}"] = f32(m)
                for i, e in enumerate(rec["img_emb"]):
                    out[p + f"img_emb.{i}"] = f32(e)
                out[p + "prefix_pad_masks"] = f32(rec["prefix"][1])
                out[p + "prefix_att_masks"] = f32(rec["prefix"][2])
                out[p + "step0.suffix_pad_masks"] = f32(rec["suffix"][0][1])
                out[p + "step0.suffix_att_masks"] = f32(rec["suffix"][0][2])
                if call == 1:
                    for layer, kv in sorted(rec["kv"].items()):
                        out[p + f"kv.{layer}.key"] = f32(kv["key_states"])
                        out[p + f"kv.{layer}.value"] = f32(kv["value_states"])
    finally:
        for obj, name, _ in originals:
            delattr(obj, name)
    return out


KEY_DOC = {
    "cN.in.<feature>": "raw observation given to the preprocessor: images as uint8 (B,3,H,W), fed as float32 "
                       "np.float32(u8) / np.float32(255) in [0,1]; state float32 (B,S)",
    "cN.in.task": "the task strings (the preprocessor appends '\\n' before tokenising)",
    "cN.noise": "noise passed to predict_action_chunk, (B, chunk_size, max_action_dim) float32",
    "cN.pre.observation.state": "normalised state, (state - mean) / (std + 1e-8), (B,S)",
    "cN.pre.observation.language.tokens": "token ids from the preprocessor's tokenizer step (int64)",
    "cN.pre.observation.language.attention_mask": "their attention mask (bool)",
    "cN.state_padded": "normalised state zero-padded to max_state_dim (prepare_state)",
    "c1.images.<i>": "image i (order of config.image_features) as the model sees it (prepare_images: "
                     "resize_with_pad to 64x64 padding with 0, then x*2-1); stored only where the source is not "
                     "64x64 (for 64x64 sources it is exactly in*2-1)",
    "cN.img_masks.<i>": "image i's mask (B,) bool",
    "cN.img_emb.<i>": "vlm_with_expert.embed_image(image i): connector output before the sqrt(hidden) "
                      "scaling (bf16 values)",
    "cN.prefix_embs": "embed_prefix output embeddings (B, Lp, text hidden)",
    "cN.prefix_pad_masks": "embed_prefix pad masks (B, Lp) bool",
    "cN.prefix_att_masks": "embed_prefix autoregressive masks (B, Lp) bool",
    "c1.kv.<layer>.key / .value": "KV cache of the prefix pass per VLM layer, (B, Lp, kv_heads, head_dim); "
                                  "keys after RoPE",
    "cN.step<k>.x_t / .time / .v_t": "denoise_step k: input x_t (B,chunk,max_action_dim), time (B,), output velocity",
    "cN.step0.suffix_embs / _pad_masks / _att_masks": "embed_suffix output at the first denoising step",
    "cN.x_final": "x after the last Euler step (B, chunk, max_action_dim), = last x_t + dt * last v_t",
    "cN.actions_norm": "predict_action_chunk output: x_final[..., :action_dim] (normalised actions)",
    "cN.actions": "postprocessor output: actions_norm * std + mean (B, chunk, action_dim)",
    "fp32.cN.*": "the same quantities from the same files loaded with load_vlm_weights=False, where the VLM is built "
                 "from its config in float32 and every computation runs in float32 (the VLM weights in "
                 "model.safetensors are bf16 values, exactly representable), SigLIP's patches numbered in raster "
                 "order (module docstring)",
}


class raster_patch_positions:
    """Within it, SmolVLM's vision embeddings number the patches in raster order in every dtype (see
    the module docstring), as in bfloat16 and in transformers 5."""

    def __enter__(self):
        from transformers.models.smolvlm import modeling_smolvlm as m
        self.cls, self.forward = m.SmolVLMVisionEmbeddings, m.SmolVLMVisionEmbeddings.forward

        def forward(emb, pixel_values, patch_attention_mask=None):
            patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
            assert patches.shape[1] == emb.num_positions, "images of the vision tower's own size only"
            ids = torch.arange(patches.shape[1], device=pixel_values.device).expand(pixel_values.shape[0], -1)
            return patches + emb.position_embedding(ids)
        self.cls.forward = forward
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.forward


def generate(out_root: Path) -> None:
    import lerobot
    import transformers
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (batch_to_transition, policy_action_to_transition,
                                              transition_to_batch, transition_to_policy_action)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out_root = out_root.resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    vlm_dir = out_root / "vlm"
    if vlm_dir.exists():
        shutil.rmtree(vlm_dir)
    build_vlm(vlm_dir)

    for name, cfg in CONFIGS.items():
        case = out_root / name
        if case.exists():
            shutil.rmtree(case)
        pdir = case / "policy"
        input_features = {k: PolicyFeature(type=FeatureType.VISUAL, shape=s) for k, s in cfg["cameras"].items()}
        input_features["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(cfg["state_dim"],))
        output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(cfg["action_dim"],))}
        config = SmolVLAConfig(vlm_model_name=str(vlm_dir), input_features=input_features,
                               output_features=output_features, **COMMON_POLICY, **cfg["policy"])
        torch.manual_seed(cfg["seed"])
        policy = SmolVLAPolicy(config)
        g = torch.Generator().manual_seed(200 + cfg["seed"])
        # The VLM's weights were perturbed when it was built (vlm/ holds the same values); perturb the rest.
        perturb_([(n, p) for n, p in policy.named_parameters() if not n.startswith("model.vlm_with_expert.vlm.")], g)
        stats = make_stats(cfg)
        pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
        policy.save_pretrained(pdir)
        pre.save_pretrained(pdir)
        post.save_pretrained(pdir)
        del policy, pre, post

        # The VLM path travels as "./vlm", relative to out_root.
        cj = json.loads((pdir / "config.json").read_text())
        assert cj["vlm_model_name"] == str(vlm_dir)
        cj["vlm_model_name"] = VLM_REL
        (pdir / "config.json").write_text(json.dumps(cj, indent=4) + "\n")
        pj = json.loads((pdir / "policy_preprocessor.json").read_text())
        n_tok = 0
        for step in pj["steps"]:
            if step.get("config", {}).get("tokenizer_name") == str(vlm_dir):
                step["config"]["tokenizer_name"] = VLM_REL
                n_tok += 1
        assert n_tok == 1, pj
        (pdir / "policy_preprocessor.json").write_text(json.dumps(pj, indent=4) + "\n")
        for f in pdir.iterdir():
            assert str(out_root) not in f.read_bytes().decode("latin-1"), f"absolute path left in {f}"

        # Every output below comes from the files as written, loaded the way LeRobot loads them.
        cwd = os.getcwd()
        os.chdir(out_root)
        try:
            rel = f"{name}/policy"
            pre = PolicyProcessorPipeline.from_pretrained(rel, config_filename="policy_preprocessor.json",
                                                          to_transition=batch_to_transition,
                                                          to_output=transition_to_batch)
            post = PolicyProcessorPipeline.from_pretrained(rel, config_filename="policy_postprocessor.json",
                                                           to_transition=policy_action_to_transition,
                                                           to_output=transition_to_policy_action)
            torch.manual_seed(0)
            policy = SmolVLAPolicy.from_pretrained(rel)
            dtypes = sorted({f"{n.split('.')[2]}:{p.dtype}" for n, p in policy.named_parameters()
                             if n.startswith("model.vlm_with_expert.")})
            arrays = run_calls(policy, pre, post, cfg, full=True)
            attn_impl = {"vision": policy.model.vlm_with_expert.vlm.config.vision_config._attn_implementation,
                         "text": policy.model.vlm_with_expert.vlm.config.text_config._attn_implementation}
            loaded_cfg = policy.config
            del policy

            fp32_cfg = PreTrainedConfig.from_pretrained(rel)
            fp32_cfg.load_vlm_weights = False
            torch.manual_seed(0)
            policy32 = SmolVLAPolicy.from_pretrained(rel, config=fp32_cfg)
            assert all(p.dtype == torch.float32 for p in policy32.parameters())
            with raster_patch_positions():
                arrays.update({"fp32." + k: v for k, v in run_calls(policy32, pre, post, cfg, full=False).items()})
            del policy32
        finally:
            os.chdir(cwd)

        np.savez_compressed(case / "io.npz", **dict(sorted(arrays.items())))
        meta = {
            "description": "Golden outputs of LeRobot's SmolVLAPolicy: actions = post(policy.predict_action_chunk("
                           "pre(obs), noise=noise)) for two calls c1, c2 (batch 2), policy and processors loaded "
                           "from policy/ with cwd = the directory above this one (vlm path './vlm').",
            "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "numpy": np.__version__,
                         "python": sys.version.split()[0]},
            "vlm_model_name_in_files": VLM_REL,
            "vlm_path_resolution": "relative to tests/golden/smolvla (the parent of this directory): chdir "
                                   "there, or override config.vlm_model_name and the tokenizer_processor step's "
                                   "tokenizer_name with the absolute path of tests/golden/smolvla/vlm",
            "generator_config": {k: (v if k != "cameras" else {c: list(s) for c, s in v.items()})
                                 for k, v in cfg.items()},
            "policy_config": {k: getattr(loaded_cfg, k) for k in (
                "chunk_size", "n_action_steps", "num_steps", "max_state_dim", "max_action_dim", "num_vlm_layers",
                "num_expert_layers", "self_attn_every_n_layers", "expert_width_multiplier", "attention_mode",
                "add_image_special_tokens", "prefix_length", "pad_language_to", "tokenizer_max_length",
                "use_cache", "min_period", "max_period", "load_vlm_weights")} | {
                "resize_imgs_with_padding": list(loaded_cfg.resize_imgs_with_padding)},
            "param_dtypes_lerobot_path": dtypes,
            "attn_implementation_of_hf_modules": attn_impl,
            "tasks": {f"c{c}": t for c, t in TASKS.items()},
            "notes": [
                "LeRobot's path (load_vlm_weights=True) loads the VLM in bfloat16 and builds the expert from the "
                "VLM's text config, so the expert is bfloat16 too except the cross-attention k_proj/v_proj "
                "(nn.Linear, float32); state_proj, action_in/out_proj and action_time_mlp_* are float32. The "
                "fp32.* keys are the all-float32 computation of the same weights.",
                "SmolVLM's vision position ids come from torch.bucketize of arange(n)/n*(1-1e-6) computed in the "
                "pixel dtype: in bfloat16 (1-1e-6) rounds to 1 and the ids are 0..15 (raster order); in float32 "
                "each coordinate falls one bucket lower, per side [0, 0, 1, 2]. The fp32.* keys were computed with "
                "raster ids (raster_patch_positions in the generator), as bfloat16 and transformers 5 number them.",
            ],
            "keys": KEY_DOC,
            "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in sorted(arrays.items())},
        }
        (case / "io.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name}: actions c1 {arrays['c1.actions'].shape}, max |bf16 - fp32| = "
              f"{np.abs(arrays['c1.actions'] - arrays['fp32.c1.actions']).max():.3g}")


RELEASED = Path(__file__).resolve().parents[2] / "common" / "policy" / "smolvla" / "released.py"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "special_tokens_map.json", "tokenizer.json",
                   "tokenizer_config.json", "video_preprocessor_config.json")


def released_configs() -> tuple[dict, dict]:
    """(the VLM's config.json, smolvla_base's config.json) as released.py writes them (a file of
    data: it imports nothing when loaded)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("smolvla_released", RELEASED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return copy.deepcopy(module.SMOLVLM2_500M_VIDEO_INSTRUCT), copy.deepcopy(module.SMOLVLA_BASE)


def count(out: Path) -> None:
    """LeRobot's SmolVLAPolicy at smolvla_base's shape on the meta device: its parameter count."""
    import dataclasses
    import hashlib
    import tempfile

    import lerobot
    import transformers
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    vlm_json, base = released_configs()
    fields = {f.name for f in dataclasses.fields(SmolVLAConfig)}
    unknown = sorted(set(base) - fields - {"type"})
    assert not unknown, f"smolvla_base keys SmolVLAConfig does not have: {unknown}"
    features = lambda d: {k: PolicyFeature(type=FeatureType[f["type"]], shape=tuple(f["shape"]))  # noqa: E731
                          for k, f in d.items()}
    kwargs = {k: v for k, v in base.items() if k != "type"} | {
        "input_features": features(base["input_features"]), "output_features": features(base["output_features"]),
        "normalization_mapping": {k: NormalizationMode(v) for k, v in base["normalization_mapping"].items()},
        "resize_imgs_with_padding": tuple(base["resize_imgs_with_padding"])}
    golden_vlm = Path(__file__).resolve().parents[1] / "golden" / "smolvla" / "vlm"
    with tempfile.TemporaryDirectory() as tmp:
        vlm_dir = Path(tmp) / "SmolVLM2-500M-Video-Instruct"
        vlm_dir.mkdir()
        (vlm_dir / "config.json").write_text(json.dumps(vlm_json, indent=2) + "\n")
        for name in PROCESSOR_FILES:
            shutil.copyfile(golden_vlm / name, vlm_dir / name)
        kwargs |= {"vlm_model_name": str(vlm_dir), "load_vlm_weights": False, "device": "cpu"}
        with torch.device("meta"):
            policy = SmolVLAPolicy(SmolVLAConfig(**kwargs))
    assert all(p.is_meta for p in policy.parameters())
    vwe = policy.model.vlm_with_expert
    n = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    total, vlm, expert = n(policy), n(vwe.vlm), n(vwe.lm_expert)
    named = sorted((k.removeprefix("model."), list(p.shape)) for k, p in policy.named_parameters())
    lines = "".join(f"{k} {shape}\n" for k, shape in named)
    result = {
        "description": "Parameters of LeRobot's SmolVLAPolicy at lerobot/smolvla_base's shape, built on the meta "
                       "device (load_vlm_weights=False) from vlm_config and smolvla_config (released.py's). "
                       "vlm: model.vlm_with_expert.vlm (the VLM cut to num_vlm_layers, its lm_head included), "
                       "lm_expert: model.vlm_with_expert.lm_expert, projections: the rest (state_proj, "
                       "action_in_proj, action_out_proj, action_time_mlp_in/out). parameter_names_sha256: sha256 "
                       "of one line '<name without model.> [shape]' per parameter, sorted by name.",
        "written_by": "tests/interop/smolvla_side.py count",
        "parameters": {"total": total, "vlm": vlm, "lm_expert": expert, "projections": total - vlm - expert},
        "vlm_parts": {name: n(getattr(vwe.vlm.model, name)) for name in ("vision_model", "connector", "text_model")}
                     | {"lm_head": n(vwe.vlm.lm_head)},
        "tensors": len(named),
        "parameter_names_sha256": hashlib.sha256(lines.encode()).hexdigest(),
        "versions": {"lerobot": lerobot.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "vlm_config": vlm_json,
        "smolvla_config": base,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"smolvla_base: {total:,} parameters (vlm {vlm:,}, lm_expert {expert:,}, projections "
          f"{total - vlm - expert:,}); wrote {out}")


def act(policy_dir: Path, io: Path, out: Path) -> None:
    """LeRobot acting with a policy directory another program wrote (asyncvla's export in LeRobot's
    format): post(policy.predict_action_chunk(pre(obs), noise)) on the inputs and noise of io.npz's
    calls c1 and c2 (a golden fixture's), in float32 with raster patch positions as the float32
    references are made; the actions of each call into out.npz."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (batch_to_transition, policy_action_to_transition,
                                              transition_to_batch, transition_to_policy_action)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    pre = PolicyProcessorPipeline.from_pretrained(str(policy_dir), config_filename="policy_preprocessor.json",
                                                  to_transition=batch_to_transition, to_output=transition_to_batch)
    post = PolicyProcessorPipeline.from_pretrained(str(policy_dir), config_filename="policy_postprocessor.json",
                                                   to_transition=policy_action_to_transition,
                                                   to_output=transition_to_policy_action)
    policy = SmolVLAPolicy.from_pretrained(str(policy_dir))
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    z, result = np.load(io), {}
    for call in ("c1", "c2"):
        obs = {k[len(call) + 4:]: torch.from_numpy(z[k].astype(np.float32) / np.float32(255))
               for k in z.files if k.startswith(f"{call}.in.observation.images")}
        obs["observation.state"] = torch.from_numpy(z[f"{call}.in.observation.state"])
        obs["task"] = [str(t) for t in z[f"{call}.in.task"]]
        with raster_patch_positions():
            actions = post(policy.predict_action_chunk(pre(obs), noise=torch.from_numpy(z[f"{call}.noise"])))
        result[f"{call}.actions"] = f32(actions)
    np.savez(out, **result)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "count":
        count(Path(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "act":
        act(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif len(sys.argv) == 2:
        generate(Path(sys.argv[1]))
    else:
        sys.exit(__doc__)
