"""The model families this project builds, and what sets each apart: one record per HF
architecture (config.json's `architectures`), read by the name map (model/qwen3.py), the model
builder (megatron/model.py), the parameter counts (model/arch.py) and `plan` alike, so none
accepts a model another refuses (docs/models.md has the table).

All four are the same decoder (GQA attention with RoPE, SwiGLU MLP, RMSNorm, tied or untied
embeddings) under the same HF tensor names; they differ in

  Qwen3ForCausalLM      per-head RMSNorm of q and k (q_norm / k_norm); default RoPE
  Qwen3MoeForCausalLM   Qwen3 with routed experts (megatron/moe.py)
  LlamaForCausalLM      no q/k norm; default or `llama3` RoPE (Llama 3.1 / 3.2's scaling)
  Qwen2ForCausalLM      no q/k norm; q/k/v biases (o_proj has none); default RoPE (Qwen2.5)

Plain torch and transformers configs: no Megatron import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    architecture: str
    qk_norm: bool  # q_norm / k_norm per head (Megatron's qk_layernorm)
    qkv_bias: bool  # q/k/v projections carry biases (Megatron's add_qkv_bias); o_proj never does
    rope_types: tuple  # the RoPE types the builder reproduces
    moe: bool = False


FAMILIES = {
    f.architecture: f
    for f in (
        Family("Qwen3ForCausalLM", qk_norm=True, qkv_bias=False, rope_types=("default",)),
        Family("Qwen3MoeForCausalLM", qk_norm=True, qkv_bias=False, rope_types=("default",), moe=True),
        Family("LlamaForCausalLM", qk_norm=False, qkv_bias=False, rope_types=("default", "llama3")),
        Family("Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, rope_types=("default",)),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# llama3 RoPE's keys (transformers' _compute_llama3_parameters reads all four).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def architectures(hf_config) -> list:
    """config.json's architectures, or the one a config class without them stands for."""
    named = getattr(hf_config, "architectures", None)
    return list(named or [type(hf_config).__name__.replace("Config", "ForCausalLM")])


def family_of(hf_config) -> Family:
    """The family of a transformers config; a ValueError naming config.json's architectures and
    the supported ones otherwise."""
    archs = architectures(hf_config)
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    raise ValueError(
        f"config.json architectures={archs}: only {SUPPORTED_ARCHITECTURES} are supported "
        "(model/families.py: the families megatron_dppo.megatron.model builds and model/qwen3.py maps)"
    )


def rope_parameters(hf_config) -> dict:
    """config.json's RoPE settings (transformers 5's rope_parameters; rope_scaling / rope_theta of
    an older config) -> {"rope_type", "rope_theta", and llama3's four keys}. A ValueError naming
    the field for a type the family's builder does not reproduce, or a llama3 key missing."""
    family = family_of(hf_config)
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    field = "rope_parameters" if getattr(hf_config, "rope_parameters", None) else "rope_scaling"
    if rope_type not in family.rope_types:
        raise ValueError(
            f"config.json {field}.rope_type={rope_type!r}: {family.architecture} is built with "
            f"{' or '.join(repr(t) for t in family.rope_types)} RoPE only"
        )
    out = {"rope_type": rope_type, "rope_theta": float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 1e4)))}
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if not isinstance(rope.get(k), (int, float))]
        if missing:
            raise ValueError(f"config.json {field}: rope_type 'llama3' needs {missing} (numbers)")
        if not rope["high_freq_factor"] > rope["low_freq_factor"]:
            raise ValueError(
                f"config.json {field}: llama3 high_freq_factor={rope['high_freq_factor']} must exceed "
                f"low_freq_factor={rope['low_freq_factor']}"
            )
        out.update({k: rope[k] for k in LLAMA3_ROPE_KEYS})
    return out


def check_supported(hf_config) -> Family:
    """What the trainer, the converters and `megatron-dppo plan` refuse alike: a ValueError naming
    the config.json field the model builder (megatron/model.py) does not carry. -> the family."""
    family = family_of(hf_config)
    if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(hf_config, "layer_types", None) or ()
    ):
        raise ValueError(
            f"config.json use_sliding_window=true ({family.architecture}): sliding-window attention is not "
            "supported (every layer attends to the whole sequence here)"
        )
    rope_parameters(hf_config)
    # Biases the family does not have: Llama's attention_bias puts them on q, k, v and o, and
    # mlp_bias on the MLP; neither is mapped (Qwen2's q/k/v biases are the family's own).
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"config.json attention_bias=true ({family.architecture}): q/k/v/o biases are not mapped")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"config.json mlp_bias=true ({family.architecture}): MLP biases are not mapped")
    if int(getattr(hf_config, "pretraining_tp", 1) or 1) != 1:
        raise ValueError(f"config.json pretraining_tp={hf_config.pretraining_tp}: only 1 is supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if experts:
        k = getattr(hf_config, "num_experts_per_tok", 0)
        if not 1 <= k <= experts:
            raise ValueError(f"config.json num_experts_per_tok={k}: expected 1..num_experts ({experts})")
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise ValueError("config.json shared_expert_intermediate_size: shared experts are not mapped")
    return family
