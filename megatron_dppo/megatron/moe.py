"""Qwen3 mixture-of-experts layers (transformers' Qwen3MoeConfig) as Megatron-Core MoE layers.

What transformers' Qwen3MoeSparseMoeBlock computes, and the Megatron setting that does the same:
  router logits = x W_gate^T, in fp32          moe_router_dtype="fp32"
  softmax over all experts, top-k, and with    norm_topk_prob=False: moe_router_pre_softmax=True
  norm_topk_prob the k weights renormalised    (softmax, then top-k); True: pre_softmax=False
                                               (top-k logits, then softmax over those k: the
                                               same renormalised weights)
  each expert a SwiGLU MLP of                  moe_ffn_hidden_size; fc1 = [gate; up] per expert
  moe_intermediate_size
  no shared experts                            moe_shared_expert_intermediate_size=None
  dense layers among MoE ones: a layer is      a per-layer spec list (and moe_layer_freq, which
  sparse unless in mlp_only_layers, and only   decides how dist checkpoints stack the layers)
  every decoder_sparse_step-th one
Experts run as SequentialMLP on the local spec (CPU, or a GPU without Transformer Engine) and as
TE grouped GEMM (TEGroupedMLP) on the TE spec; both save the same dist-checkpoint keys. Tokens
reach the experts of other expert-parallel ranks through the alltoall dispatcher.

Names (local spec; TE in brackets), layer L, local expert e (global expert ep_rank * E/ep + e):
  decoder.layers.L.mlp.router.weight                              [E, hidden]
  decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight  [2 I, hidden]  (gate; up)
                    [decoder.layers.L.mlp.experts.linear_fc1.weight<e>]
  decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight  [hidden, I]
                    [decoder.layers.L.mlp.experts.linear_fc2.weight<e>]
  decoder.layers.L.pre_mlp_layernorm.weight  on both specs: an MoE layer's norm is not fused into
                    a linear, so (unlike Megatron's local MoE spec) it keeps this name in
                    checkpoints, and a local-spec checkpoint loads into a TE model.
"""

from __future__ import annotations

import copy

from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dppo.megatron.cpu_compat import patch_moe_without_te
from megatron_dppo.model.qwen3 import moe_layer_pattern


def is_moe(hf_config) -> bool:
    """Whether any decoder layer is sparse (Qwen3MoeConfig maps num_experts to num_local_experts,
    the name its config.json carries; a dense Qwen3Config has neither)."""
    return any(moe_layer_pattern(hf_config))


def transformer_config_kwargs(hf_config, backend: str) -> dict:
    """TransformerConfig fields of the MoE layers at the current EP / expert-TP sizes; {} for a
    dense model."""
    if not is_moe(hf_config):
        return {}
    patch_moe_without_te()
    pattern = moe_layer_pattern(hf_config)
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
        moe_router_dtype="fp32",
        # The load-balancing loss term exists but is off (coefficient 0), as RL recipes run it.
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=backend == "te",
        # An int 1 when every layer is sparse (the real Qwen3 MoE models): Megatron then stacks
        # the layers in dist checkpoints as for a dense model; a list keys them per layer.
        moe_layer_freq=1 if all(pattern) else [int(p) for p in pattern],
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def moe_layer_spec(dense_spec, backend: str):
    """The dense layer spec (its attention as model.py chose it) with the MLP replaced by an MoE
    layer and an unfused pre-MLP norm."""
    spec = copy.deepcopy(dense_spec)
    sub = spec.submodules
    if backend == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        provider = TESpecProvider()
        sub.pre_mlp_layernorm = provider.layer_norm()  # the dense TE spec fuses it into fc1
    else:
        from megatron.core.models.backends import LocalSpecProvider

        provider = LocalSpecProvider()
    sub.mlp = get_moe_module_spec_for_backend(provider, num_experts=1, moe_grouped_gemm=backend == "te")
    # Only the dense local spec's fc1 renaming goes: an MoE layer has no fused fc1 norm.
    sub.sharded_state_dict_keys_map = {
        k: v for k, v in sub.sharded_state_dict_keys_map.items() if not k.startswith("pre_mlp_layernorm")
    }
    return spec


def decoder_spec(hf_config, config, backend: str, dense_spec, vp_stage: int | None = None):
    """transformer_layer_spec for GPTModel: the dense spec itself for a dense model, else this
    pipeline stage's per-layer specs (dense ones where transformers has dense layers)."""
    if not is_moe(hf_config):
        return dense_spec
    sparse = moe_layer_spec(dense_spec, backend)
    specs = [sparse if p else dense_spec for p in moe_layer_pattern(hf_config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    here = specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=here, layer_norm=LayerNormImpl)
