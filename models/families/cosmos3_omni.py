"""Cosmos3-Omni (Cosmos3-Nano): Qwen3-VL's tower with DeepStack. Its checkpoints (the released unified one,
and transformers' save_pretrained, which writes transformers' own conversion back) keep the vision tensors
with no prefix at all: `blocks.*`, `merger.*`, `patch_embed.*`, `pos_embed.*`, `deepstack_merger_list.*`,
beside the language model's flat `layers.*`. Images as Qwen2-VL's processor, videos as Qwen3-VL's."""

from models.families.qwen3_vl import QWEN3_VL
from models.family import register

FLAT_ROOTS = ("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list.")

COSMOS3_OMNI = register(QWEN3_VL.derive(
    model_type="cosmos3_omni", title="Cosmos3-Omni",
    prefixes=(*QWEN3_VL.prefixes, *((root, root) for root in FLAT_ROOTS)),  # flat roots keep their names
    hf_class="Cosmos3OmniForConditionalGeneration",
))
