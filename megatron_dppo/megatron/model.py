"""The supported families (model/families.py: Qwen3 dense and MoE, Llama, Qwen2) as Megatron-Core
GPTModels, built from a transformers config: qk_layernorm for Qwen3's q/k norms, add_qkv_bias for
Qwen2's q/k/v biases, llama3 RoPE scaling applied with all of config.json's keys.

Two attention paths behind one switch (megatron/attention_backend.py decides "auto"):
  "te"    Transformer Engine layer spec (fused kernels, THD varlen attention); needs CUDA + TE.
  "local" Megatron-Core's local spec with core_attention replaced by PackedDotProductAttention
          (torch SDPA per packed sequence); works on CPU and on a GPU without TE.

Parameter names follow the spec (docs/platform.md section 1 has the HF <-> Megatron table): the local spec
has decoder.layers.L.{input,pre_mlp}_layernorm.weight, the TE spec folds them into
linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_dppo.megatron import moe
from megatron_dppo.megatron.attention import PackedDotProductAttention
from megatron_dppo.megatron.attention_backend import attention_choice
from megatron_dppo.model import families
from megatron_dppo.model.vocab import VOCAB_DIVISIBLE_BY, padded_vocab_size


def resolve_attention_backend(
    attention: str = "auto", *, dtype: torch.dtype | None = None, sequence_parallel: bool = False, packed: bool = True
) -> str:
    """The backend ("te" or "local") for model.attention: attention_backend.choose_attention's rules."""
    return attention_choice(attention, dtype=dtype, sequence_parallel=sequence_parallel, packed=packed).backend


def current_device() -> torch.device:
    """This rank's device: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a model's parameters live: the device its inputs must be moved to."""
    return next(module.parameters()).device


@dataclasses.dataclass(frozen=True)
class GpuSettings:
    """parallel's GPU performance keys as the policy applies them (config.resolve_gpu_settings
    resolves them per machine). The defaults are the CPU's: the behaviour before the keys existed."""

    overlap_grad_reduce: bool = False  # DDP reduces each bucket during the backward
    ddp_bucket_size: int = 0  # parameters per DDP bucket, 0 = one bucket
    gradient_accumulation_fusion: bool = False  # TE linears add their wgrad into main_grad
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    recompute_modules: tuple[str, ...] = ("core_attn", "mlp")  # parallel.recompute=selective's

    @classmethod
    def from_config(cls, par) -> GpuSettings:
        """From a resolved ParallelConfig (recompute_modules is unset unless recompute=selective)."""
        values = {f.name: getattr(par, f.name) for f in dataclasses.fields(cls) if f.name != "recompute_modules"}
        return cls(**values, recompute_modules=tuple(par.recompute_modules or cls.recompute_modules))

    def transformer_overrides(self) -> dict:
        """The TransformerConfig fusions that are on (none on the CPU: its config is unchanged)."""
        fusions = ("gradient_accumulation_fusion", "moe_permute_fusion", "moe_router_fusion")
        return {name: True for name in fusions if getattr(self, name)}


def _apply_rope_scaling(model: GPTModel, hf_config) -> None:
    """llama3 RoPE (Llama 3.1 / 3.2) with all four of config.json's keys. Megatron-Core's
    RotaryEmbedding(rope_scaling=True) passes it `factor` only and fixes low/high_freq_factor at
    1 / 4 and the original context at 8192 (tests/unit/test_families.py shows a config where that
    differs from transformers); its own _apply_scaling takes all four, so it is called here on the
    unscaled frequencies, before any forward caches them."""
    rope = families.rope_parameters(hf_config)
    if rope["rope_type"] == "llama3" and hasattr(model, "rotary_pos_emb"):
        emb = model.rotary_pos_emb
        emb.inv_freq = emb._apply_scaling(emb.inv_freq, **{k: rope[k] for k in families.LLAMA3_ROPE_KEYS})


def transformer_config(hf_config, *, params_dtype=torch.float32, attention="auto", **overrides):
    """TransformerConfig for a model of a supported family (model/families.py) at the current
    TP/PP sizes."""
    family = families.check_supported(hf_config)
    backend = resolve_attention_backend(attention, dtype=params_dtype)
    on_cpu = not torch.cuda.is_available()
    fuse = backend == "te"  # jit/TE fusions; the CPU and the plain-GPU path run unfused
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        # Qwen3's head_dim is not always hidden / heads.
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=family.qk_norm,
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up] per TP rank
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=hf_config.initializer_range,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        # With use_cpu_initialization every rank builds the full master weight from the same
        # seed and keeps its slice: the initial model does not depend on TP.
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=fuse,
        bias_dropout_fusion=fuse,
        apply_rope_fusion=fuse,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(moe.transformer_config_kwargs(hf_config, backend))  # {} for a dense model
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(backend: str, thd_attention: str = "auto", qk_norm: bool = True):
    """One decoder layer's spec. thd_attention: the local path's packed-attention kernel
    (model.thd_attention: megatron/attention.py), fixed here when the model is built. qk_norm:
    the family's q/k RMSNorm (Qwen3's; Llama and Qwen2 have none)."""
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PackedDotProductAttention, params={"thd_impl": thd_attention}
    )
    return spec


def block_spec(layer, backend: str, config, vp_stage: int | None = None):
    """The decoder block around a layer spec. Megatron picks a block's final norm when it is
    imported: TENorm when TE imports, else Apex's FusedLayerNorm when Apex imports (it asserts
    on RMSNorm: a container whose TE is broken but whose Apex loads), else torch's. The local spec
    sets it to its layers' own norm (torch RMSNorm) instead, whatever imports."""
    if backend == "te":
        return layer  # TE imports, so Megatron's choice is TENorm, which does RMSNorm
    if isinstance(layer, TransformerBlockSubmodules):  # already a block: fix its final norm only
        norm = layer.layer_specs[0].submodules.input_layernorm
        return dataclasses.replace(layer, layer_norm=norm)
    layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=layer.submodules.input_layernorm)


def build_gpt_model(
    hf_config,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    params_dtype=torch.float32,
    attention: str = "auto",
    thd_attention: str = "auto",
    make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY,
    **config_overrides,
) -> GPTModel:
    """This rank's stage of the model's GPTModel (parallel state must be initialised).

    pre_process / post_process default to whether this rank is the first / last PP stage.
    model.vocab_size is the padded vocabulary (see padded_vocab_size); the forward with
    labels=None returns this rank's vocab slice of the logits, [b, s, vocab_size / tp].
    """
    sequence_parallel = bool(config_overrides.get("sequence_parallel")) and (
        parallel_state.get_tensor_model_parallel_world_size() > 1
    )
    backend = resolve_attention_backend(attention, dtype=params_dtype, sequence_parallel=sequence_parallel)
    config = transformer_config(hf_config, params_dtype=params_dtype, attention=backend, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(vp_stage is None, vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(vp_stage is None, vp_stage)
    tp = config.tensor_model_parallel_size
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            moe.decoder_spec(
                hf_config, config, backend, layer_spec(backend, thd_attention, config.qk_layernorm), vp_stage
            ),
            backend,
            config,
            vp_stage,
        ),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=families.rope_parameters(hf_config)["rope_theta"],
        vp_stage=vp_stage,
    )
    _apply_rope_scaling(model, hf_config)
    # Norm weights are created in fp32 whatever params_dtype says (Megatron-LM casts the whole
    # model with Float16Module); cast here so one model has one dtype.
    return model.to(params_dtype)
