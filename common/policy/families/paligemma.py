"""PaliGemma 1 and 2 (the VLM of pi0 and pi0.5): SigLIP vision, a linear projector, a Gemma LM.

Prompt: <image> x n, then <bos> and the instruction, as PaliGemma's processor lays it out; n =
(side / patch)^2, the side the vision tower takes (`vision_config.image_size`, 224 for the -224
checkpoints). Gemma scales its token embeddings by sqrt(hidden) itself; the projected image
features go in unscaled, as in PaliGemma's own forward.

Attention is PaliGemma's prefix LM, as in its pretraining and in pi0: the prompt (image,
instruction, state token) attends to itself in both directions, the action tokens causally (each
sees the whole prompt and the action tokens before it; the parallel head's queries see each
other). The policy hands the language model that 4-D mask itself (action_head.query_attention_mask).
"""

from __future__ import annotations

from transformers import PaliGemmaConfig

from . import Family, need
from .idefics3 import token_ids


class PaliGemma(Family):
    name = "paligemma"
    model_types = ("paligemma",)
    image_token = "<image>"
    special_tokens = ("<image>",)
    prefix_bidirectional = True

    def tiny_config(self, bcfg, image_size: int, tokenizer) -> PaliGemmaConfig:
        need(image_size % bcfg.patch_size == 0,
             f"policy.image_size={image_size} must be a multiple of policy.backbone.patch_size={bcfg.patch_size}")
        ids = token_ids(tokenizer)
        return PaliGemmaConfig(
            vision_config=dict(model_type="siglip_vision_model", hidden_size=bcfg.vision_hidden_size,
                               intermediate_size=4 * bcfg.vision_hidden_size, num_hidden_layers=bcfg.vision_layers,
                               num_attention_heads=bcfg.vision_heads, image_size=image_size,
                               patch_size=bcfg.patch_size, vision_use_head=False),
            text_config=dict(model_type="gemma", hidden_size=bcfg.text_hidden_size,
                             intermediate_size=bcfg.intermediate_size, num_hidden_layers=bcfg.text_layers,
                             num_attention_heads=bcfg.text_heads, num_key_value_heads=1,
                             head_dim=bcfg.text_hidden_size // bcfg.text_heads, vocab_size=bcfg.vocab_size,
                             max_position_embeddings=4096, pad_token_id=ids["pad"], bos_token_id=ids["bos"],
                             eos_token_id=ids["eos"]),
            image_token_index=tokenizer.convert_tokens_to_ids(self.image_token),
            projection_dim=bcfg.text_hidden_size, vocab_size=bcfg.vocab_size, pad_token_id=ids["pad"])

    def image_processor(self, bcfg, image_size: int):
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
        return SiglipImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                                       image_std=[0.5] * 3, resample=3)

    def image_features(self, vlm, pixels):
        vm = vlm.model
        return vm.multi_modal_projector(vm.vision_tower(pixel_values=pixels).last_hidden_state)

    def vision_dtype(self, vlm):
        return vlm.model.vision_tower.embeddings.patch_embedding.weight.dtype

    def position_embedding(self, vlm):
        return vlm.model.vision_tower.embeddings

    def markers(self, tokenizer):
        return [], ([] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id])


FAMILY = PaliGemma()
