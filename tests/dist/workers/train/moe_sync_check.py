"""Worker: sync_check.py for the tiny Qwen3 MoE, at expert parallel 1 (one process) or 2 (torchrun,
each rank its own vLLM engine, as the trainer runs parallel.ep=2 on two ranks).

    python moe_sync_check.py MODEL_DIR 1
    torchrun --nproc_per_node 2 moe_sync_check.py MODEL_DIR 2

After a few updates (each rank on its own batch: at EP=2 the experts see both ranks' tokens), the
weights are streamed into vLLM: every rank's engine gets every expert (gathered over the EP
group; each rank holds half of them), and vLLM's log-probs of freshly sampled sequences equal
the Megatron policy's (fp32, CPU); before the sync they do not, so the check can fail. Also the
HF names of the sync are exactly those of the model's safetensors. Each rank prints RESULT <json>.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors import safe_open
from sync_check import max_err, sampled_sequences
from transformers import AutoConfig

from megatron_dppo.algorithms.packing import Sample, build_thd_batch
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import initialize_parallel, suspend_cpu_compat
from megatron_dppo.megatron.hf_load import load_hf_into_policy
from megatron_dppo.megatron.policy import MegatronPolicy
from megatron_dppo.rollout import RolloutEngine


def main():
    model_dir, ep = sys.argv[1], int(sys.argv[2])
    initialize_parallel(1, 1, seed=0, ep=ep)
    rank = dist.get_rank()
    policy = MegatronPolicy(AutoConfig.from_pretrained(model_dir), OptimConfig(lr=3e-3), AlgorithmConfig())
    load_hf_into_policy(policy, model_dir)
    engine = RolloutEngine(
        model_dir, dtype="float32", max_model_len=32, kv_cache_memory_bytes=32 << 20, context=suspend_cpu_compat
    )
    result = {"rank": rank, "initial": max_err(policy, sampled_sequences(engine, 1))}
    seqs = sampled_sequences(engine, 2)
    gen = torch.Generator().manual_seed(rank)  # each rank its own advantages: different gradients
    batch = build_thd_batch(
        [Sample(tokens=p + c, prompt_len=len(p), advantage=float(torch.randn(1, generator=gen))) for p, c, _ in seqs]
    )
    for _ in range(3):
        policy.train_step([batch], denominator=float(batch.loss_mask.sum()))
    result["before_sync"] = max_err(policy, sampled_sequences(engine, 3))
    weights = policy.hf_state_dict()
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        result["names_match"] = sorted(weights) == sorted(f.keys())
    result["experts_synced"] = sum(".mlp.experts." in n and n.endswith("down_proj.weight") for n in weights)
    engine.load_weights(list(weights.items()))
    result["after_sync"] = max_err(policy, sampled_sequences(engine, 4))
    print("RESULT " + json.dumps(result), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
