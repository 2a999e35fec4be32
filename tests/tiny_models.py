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


def hf_reference(hf, seqs):
    """Per-sequence log-probs of transformers, and its gradients of their sum (checkpoint names)."""
    hf.zero_grad(set_to_none=True)
    out = []
    for s in seqs:
        logp = torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(1, s[1:, None])[:, 0]
        logp.sum().backward()
        out.append(logp.detach())
    return out, hf_checkpoint_tensors(hf, grads=True)


def shard_and_merge(full: dict, layout, tp: int, pp: int) -> tuple[dict, dict]:
    """Megatron tensors cut into every (tp rank, pp stage)'s shard, then merged back under global
    names -> (shards by (t, p), rebuilt): what the converters do, in one process."""
    from megatron_dppo.model import qwen3

    shards = {(t, p): qwen3.shard_for_rank(full, layout, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    rebuilt = {}
    for p in range(pp):
        for local in shards[(0, p)]:
            name = qwen3.to_global_name(local, p, pp, layout.num_layers)
            rebuilt[name] = qwen3.tp_merge(name, [shards[(t, p)][local] for t in range(tp)])
    return shards, rebuilt


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


# ---- the Llama and Qwen2 families (model/families.py) -------------------------------------------
# llama3 RoPE whose low/high_freq_factor and original context are not Megatron-Core's fixed
# 1 / 4 / 8192 (its RotaryEmbedding would scale none of these frequencies): the original context
# 64 < the 128 positions, so the scaling bites on the tiny model's sequences.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 1e4,
    "factor": 4.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 64,
}
# Qwen2 has no head_dim field (hidden / heads; vLLM's Qwen2 derives it so too): hidden 128 for 32.
FAMILY_SHAPES = {
    "llama": dict(SHAPE, architectures=["LlamaForCausalLM"]),
    "qwen2": {
        **{k: v for k, v in SHAPE.items() if k != "head_dim"},
        "hidden_size": 128,
        "architectures": ["Qwen2ForCausalLM"],
    },
}


def tiny_family_config(family: str, **overrides):
    """The tiny shape as a transformers LlamaConfig ("llama") or Qwen2Config ("qwen2")."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    copied = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}  # LLAMA3_ROPE stays as is
    return cls(**{**FAMILY_SHAPES[family], **copied})


def tiny_family_model(family: str, seed: int, **overrides):
    """(config, fp32 transformers model) of the family from `seed`, norms and biases perturbed
    (HF initialises norms to 1 and Qwen2's q/k/v biases to 0: a dropped bias would go unnoticed)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_family_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    _perturb_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return cfg, model
