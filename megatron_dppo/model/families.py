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

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    architecture: str
    qk_norm: bool  # q_norm / k_norm per head (Megatron's qk_layernorm)
    qkv_bias: bool  # q/k/v projections carry biases (Megatron's add_qkv_bias); o_proj never does
    rope_types: tuple  # the RoPE types the builder reproduces
    moe: bool = False
    required_keys: tuple = ()  # config.json keys besides REQUIRED_KEYS it must have (see there)
    vllm_reads_head_dim: bool = True  # False: vLLM's model takes hidden_size / num_attention_heads


FAMILIES = {
    f.architecture: f
    for f in (
        Family(
            "Qwen3ForCausalLM",
            qk_norm=True,
            qkv_bias=False,
            rope_types=("default",),
            required_keys=("num_key_value_heads", "head_dim"),
        ),
        Family(
            "Qwen3MoeForCausalLM",
            qk_norm=True,
            qkv_bias=False,
            rope_types=("default",),
            moe=True,
            required_keys=("num_key_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size"),
        ),
        Family("LlamaForCausalLM", qk_norm=False, qkv_bias=False, rope_types=("default", "llama3")),
        Family(
            "Qwen2ForCausalLM",
            qk_norm=False,
            qkv_bias=True,
            rope_types=("default",),
            required_keys=("num_key_value_heads",),
            vllm_reads_head_dim=False,
        ),
    )
}
# The sizes every config.json must give. transformers (5.19) fills an absent key from its config
# class's default, and where that default is a fixed number (one checkpoint's size: hidden_size
# 4096, Qwen2's and Qwen3's num_key_value_heads 32, Qwen3's head_dim 128) the model it describes
# is another one than the weights: the failure came later, naming a value the file does not hold
# ("num_key_value_heads=32", a [128, 128] vs [128, 4096] shape mismatch). Each family's
# required_keys are its other fixed-default sizes. Accepted when absent, because transformers and
# vLLM derive them alike from the other sizes: Llama's num_key_value_heads (= num_attention_heads,
# what Llama 1 / 2's config.json mean) and head_dim, Qwen2's and Qwen3 MoE's head_dim
# (hidden_size / num_attention_heads); and the non-size keys (rms_norm_eps, tie_word_embeddings,
# RoPE: transformers' default is what transformers runs). tests/unit/test_model_config_keys.py
# holds these lists to transformers' own defaults.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# What each key is, for the refusal.
KEY_MEANINGS = {
    "vocab_size": "the embedding rows",
    "hidden_size": "the model width",
    "intermediate_size": "the MLP width",
    "num_hidden_layers": "the decoder layers",
    "num_attention_heads": "the query heads",
    "num_key_value_heads": "the key/value heads",
    "head_dim": "each head's width",
    "num_experts": "the routed experts per sparse layer",
    "num_experts_per_tok": "the experts each token is routed to",
    "moe_intermediate_size": "each expert's MLP width",
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


def check_config_keys(raw: dict, hf_config, where: str = "config.json", architectures_needed: bool = True) -> None:
    """The keys config.json must hold (REQUIRED_KEYS, the family's required_keys, and architectures,
    by which vLLM picks its model class: without it vLLM 0.32 builds a non-generative model and
    fails at the first generate, advising "--runner generate"). raw: config.json as read; hf_config:
    the transformers config built from it. A ValueError naming `where`, the key(s), what each is
    and the default transformers would have taken. An unsupported family passes: family_of names it."""
    try:
        family = family_of(hf_config)
    except ValueError:
        return
    if architectures_needed and not raw.get("architectures"):
        raise ValueError(
            f'{where} has no "architectures": expected ["{family.architecture}"] for model_type '
            f"{raw.get('model_type')!r} (vLLM picks the model class by it)"
        )
    missing = [k for k in (*REQUIRED_KEYS, *family.required_keys) if not has_key(raw, k, type(hf_config))]
    if missing:
        defaults = {f.name: f.default for f in dataclasses.fields(type(hf_config))}
        named = ", ".join(f'"{k}" ({KEY_MEANINGS[k]}; transformers\' default {defaults.get(k)})' for k in missing)
        it = "it" if len(missing) == 1 else "them"
        raise ValueError(
            f"{where} has no {named}: a {family.architecture} needs {it}, as the default is another model's "
            f"size, not read from the weights; add {it} from the model's original config.json"
        )


def has_key(raw: dict, key: str, config_class) -> bool:
    """raw sets key, under its name or an alias of the config class's attribute_map (transformers 5
    writes Qwen3 MoE's num_experts as num_local_experts; Qwen's own files say num_experts)."""
    aliases = getattr(config_class, "attribute_map", {}) or {}
    names = {key, aliases.get(key)} | {alias for alias, name in aliases.items() if name == key}
    return any(raw.get(n) is not None for n in names if n)


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


def check_sliding_window(hf_config, family: Family) -> None:
    """A sliding_window that transformers ignores and vLLM applies, refused by name. transformers'
    Qwen2 / Qwen3 configs drop it unless use_sliding_window (refused above) and its Llama never reads
    it, but vLLM 0.32 windows every layer by config.json's sliding_window when the config has no
    layer_types (EngineArgs' CacheConfig), whatever use_sliding_window says (measured on a tiny
    Llama, window 8: its log-probs past position 8 moved by up to 0.31). A window as long as the
    context never bites."""
    window = getattr(hf_config, "sliding_window", None)
    context = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(window, int) or window <= 0 or getattr(hf_config, "layer_types", None) is not None:
        return
    if isinstance(context, int) and window >= context:
        return
    raise ValueError(
        f"config.json sliding_window={window} ({family.architecture}): transformers' model ignores it (every layer "
        "attends to the whole sequence, as the trainer's does), but vLLM windows every layer by it, so the "
        "rollout would sample from another model: remove the key or set it to null"
    )


def check_head_dim(hf_config, family: Family) -> None:
    """A head_dim key where the family's vLLM model ignores it (Qwen2: hidden_size /
    num_attention_heads) and transformers reads it: refused unless both agree."""
    head_dim = getattr(hf_config, "head_dim", None)
    derived = hf_config.hidden_size // hf_config.num_attention_heads
    if family.vllm_reads_head_dim or head_dim is None or head_dim == derived:
        return
    raise ValueError(
        f"config.json head_dim={head_dim} ({family.architecture}): transformers reads it, but vLLM's "
        f"{family.architecture} takes hidden_size / num_attention_heads = {hf_config.hidden_size} / "
        f"{hf_config.num_attention_heads} = {derived}: remove the key or make it {derived}"
    )


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
    check_sliding_window(hf_config, family)
    check_head_dim(hf_config, family)
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
