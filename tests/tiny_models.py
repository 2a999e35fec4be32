"""The tiny random Qwen3 the tests build (no Megatron import): its shape is defined once here.

GQA (4 query heads, 2 KV heads) and head_dim 32 (vLLM's CPU attention needs >= 32), 4 layers (PP=2
divides them), a 50-token vocabulary (Megatron pads it to 128 x TP, so vocab padding is exercised).
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    kwargs = dict(
        vocab_size=50,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def tiny_qwen3_model(seed: int, perturb_norms: bool = True, **overrides):
    """(config, fp32 transformers model) from `seed`. HF initialises every norm to 1, so a swapped or
    missing norm would go unnoticed: perturb_norms makes them differ."""
    cfg = tiny_qwen3_config(**overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    if perturb_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    return cfg, model
