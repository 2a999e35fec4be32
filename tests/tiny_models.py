"""The tiny random Qwen3 the tests build (no Megatron import): its shape is defined once here.

GQA (4 query heads, 2 KV heads) and head_dim 32 (vLLM's CPU attention needs >= 32), 4 layers (PP=2
divides them), a 50-token vocabulary (Megatron pads it to 128 x TP, so vocab padding is exercised).
The mixture-of-experts variant (tiny_qwen3_moe_*) has the same shape around its experts.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from megatron_dppo.model.qwen3 import hf_model_tensors as hf_checkpoint_tensors  # noqa: F401 (tests import it from here)

SHAPE = dict(
    vocab_size=50,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    return Qwen3Config(**{**SHAPE, "architectures": ["Qwen3ForCausalLM"], **overrides})


def _perturb_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))


def tiny_qwen3_model(seed: int, perturb_norms: bool = True, **overrides):
    """(config, fp32 transformers model) from `seed`. HF initialises every norm to 1, so a swapped or
    missing norm would go unnoticed: perturb_norms makes them differ."""
    cfg = tiny_qwen3_config(**overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    if perturb_norms:
        _perturb_norms(model)
    return cfg, model


def tiny_qwen3_moe_config(**overrides):
    """The tiny Qwen3 above as a mixture of experts: 8 experts (top-2, renormalised) of width 48 in
    layers 0, 2 and 3, and layer 1 dense (mlp_only_layers) with the dense model's MLP."""
    from transformers import Qwen3MoeConfig

    moe = dict(
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        architectures=["Qwen3MoeForCausalLM"],
    )
    return Qwen3MoeConfig(**{**SHAPE, **moe, **overrides})


def tiny_qwen3_moe_model(seed: int, **overrides):
    """(config, fp32 transformers Qwen3MoeForCausalLM) from `seed`, norms perturbed away from 1
    and router weights scaled up, so that tokens spread over the experts with clear top-2 margins
    (HF's 0.02-std init gives near-uniform routing, where a swapped expert could hide)."""
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_qwen3_moe_config(**overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float()
    _perturb_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return cfg, model
