"""The released Qwen3-Omni-30B-A3B thinker's widths, and a real-vocabulary skeleton checkpoint.

No released checkpoint is reachable offline, so the benchmarks that measure at the real widths
draw random weights at these sizes (reference/qwen3_omni_layout.md §3.1), usually with fewer
decoder layers; the tokenizer, processor and sideband come from :func:`make_skeleton`.
"""

import shutil
from pathlib import Path

VOCAB = 152064
LAYERS = 48  # text decoder layers
TEXT = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
TEXT |= {"moe_intermediate_size": 768, "intermediate_size": 768, "num_experts": 128}
TEXT |= {"num_experts_per_tok": 8, "max_position_embeddings": 65536}  # context (tiny: 4096)
# interleaved M-RoPE over head dim 128: 24 temporal, 20 height, 20 width frequency pairs
ROPE = {"rope_theta": 1e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16}
VISION |= {"num_position_embeddings": 2304, "out_hidden_size": 2048}
# the vision tower's depth: 27 blocks, deepstack taps after blocks 8, 16 and 24
VISION_DEPTH = {"depth": 27, "deepstack_visual_indexes": [8, 16, 24]}
AUDIO = {"d_model": 1280, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120}
AUDIO |= {"downsample_hidden_size": 480, "encoder_layers": 32, "conv_chunksize": 500}


def make_skeleton(dst: Path) -> Path:
    """A tiny real-vocabulary checkpoint extracted to ``dst/vl`` + ``dst/audio`` (if not there)."""
    from omni_extract import extract
    from omni_extract.tiny import TinyOmniSpec, make_tiny_omni

    if (dst / "vl").is_dir() and (dst / "audio").is_dir():  # made by an earlier run
        return dst
    omni = make_tiny_omni(dst / "omni", TinyOmniSpec(vocab="real", with_talker=False))
    extract(omni, dst / "vl", variant="vl")
    extract(omni, dst / "audio", variant="audio")
    shutil.rmtree(omni)
    return dst
