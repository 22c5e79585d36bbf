"""Idefics3 and SmolVLM (SmolVLA's backbone): SigLIP vision, a pixel-shuffle connector, a Llama LM.

Prompt: [<s>] <fake_token_around_image> <global-img> <image> x n <fake_token_around_image>, SmolVLM's
single-image block; n = (side / patch)^2 / scale_factor^2. The image side is the vision tower's
(`vision_config.image_size`): the processor's longest edge with image splitting off.
"""

from __future__ import annotations

from transformers import Idefics3Config

from . import Family, known_ids, need


class Idefics3(Family):
    name = "idefics3"
    model_types = ("idefics3", "smolvlm")
    image_token = "<image>"
    special_tokens = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
    lora_targets = r".*text_model.*\.(q_proj|k_proj|v_proj|o_proj)"

    def tiny_config(self, bcfg, image_size: int, tokenizer) -> Idefics3Config:
        need(image_size % bcfg.patch_size == 0,
             f"policy.image_size={image_size} must be a multiple of policy.backbone.patch_size={bcfg.patch_size}")
        need((image_size // bcfg.patch_size) % bcfg.scale_factor == 0,
             f"patches per side ({image_size // bcfg.patch_size}) must be a multiple of "
             f"policy.backbone.scale_factor={bcfg.scale_factor}")
        ids = token_ids(tokenizer)
        return Idefics3Config(
            vision_config=dict(hidden_size=bcfg.vision_hidden_size, intermediate_size=4 * bcfg.vision_hidden_size,
                               num_hidden_layers=bcfg.vision_layers, num_attention_heads=bcfg.vision_heads,
                               image_size=image_size, patch_size=bcfg.patch_size),
            text_config=dict(model_type="llama", hidden_size=bcfg.text_hidden_size,
                             intermediate_size=bcfg.intermediate_size, num_hidden_layers=bcfg.text_layers,
                             num_attention_heads=bcfg.text_heads, num_key_value_heads=bcfg.text_heads,
                             vocab_size=bcfg.vocab_size, max_position_embeddings=4096,
                             pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                             tie_word_embeddings=False),
            image_token_id=tokenizer.convert_tokens_to_ids(self.image_token), scale_factor=bcfg.scale_factor,
            tie_word_embeddings=False, pad_token_id=ids["pad"])

    def image_processor(self, bcfg, image_size: int):
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        return Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                         max_image_size={"longest_edge": image_size})

    def image_seq_len(self, config, model_size: int) -> int:
        return (model_size // config.vision_config.patch_size) ** 2 // config.scale_factor ** 2

    def image_features(self, vlm, pixels):
        vm = vlm.model
        return vm.connector(vm.vision_model(pixel_values=pixels).last_hidden_state)

    def vision_dtype(self, vlm):
        return vlm.model.vision_model.embeddings.patch_embedding.weight.dtype

    def position_embedding(self, vlm):
        return vlm.model.vision_model.embeddings

    def markers(self, tokenizer):
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        around = known_ids(tokenizer, "<fake_token_around_image>")
        return bos + around + known_ids(tokenizer, "<global-img>"), around

    def decoder(self, vlm):
        return vlm.model.text_model


def token_ids(tokenizer) -> dict:
    return {name: tokenizer.convert_tokens_to_ids(t) for name, t in
            (("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"))}


FAMILY = Idefics3()
