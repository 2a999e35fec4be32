"""Worker: after a weight sync, vLLM's log-probs of sampled sequences equal the Megatron
policy's (fp32, CPU), and before the sync they do not (so the check can fail).

    python sync_check.py [HF_DIR ...]    (default: examples/tiny/model)

Several dirs (the model families) are checked one after another in this process, each with its own
policy and engine (a Python start with Megatron and vLLM imported costs ~15 s): RESULT {dir: ...}."""

import json
import os
import sys

import torch
from transformers import AutoConfig

from megatron_dppo.algorithms.packing import Sample, build_thd_batch
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import initialize_parallel, suspend_cpu_compat
from megatron_dppo.megatron.hf_load import load_hf_into_policy
from megatron_dppo.megatron.policy import MegatronPolicy
from megatron_dppo.rollout import RolloutEngine

HF_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "examples", "tiny", "model")
PROMPTS = [[1, 4, 5, 6, 13, 7, 8, 9, 15], [1, 12, 3, 4, 13, 5, 5, 5, 15], [1, 9, 9, 9, 13, 3, 3, 3, 15]]


def sampled_sequences(engine, seed):
    outs = engine.generate(PROMPTS, n=4, max_new_tokens=6, temperature=1.0, seed=seed)
    return [(p, c.token_ids, torch.tensor(c.logprobs)) for p, group in zip(PROMPTS, outs) for c in group]


def megatron_logprobs(policy, seqs):
    samples = [Sample(tokens=p + c, prompt_len=len(p)) for p, c, _ in seqs]
    mb = build_thd_batch(samples)
    logp = policy.compute_logprobs([mb])[0].flatten()
    mask = mb.loss_mask.flatten() > 0
    return logp[mask], torch.cat([lp for _, _, lp in seqs])


def max_err(policy, seqs):
    ours, theirs = megatron_logprobs(policy, seqs)
    return float((ours - theirs).abs().max())


def check(hf_dir: str) -> dict:
    cfg = AutoConfig.from_pretrained(hf_dir)
    policy = MegatronPolicy(cfg, OptimConfig(lr=3e-3), AlgorithmConfig(loss_agg="token-mean"))
    load_hf_into_policy(policy, hf_dir)
    engine = RolloutEngine(
        hf_dir, dtype="float32", max_model_len=32, kv_cache_memory_bytes=32 << 20, context=suspend_cpu_compat
    )
    result = {"initial": max_err(policy, sampled_sequences(engine, 1))}
    # A few updates on the sampled sequences with arbitrary advantages move the weights.
    seqs = sampled_sequences(engine, 2)
    gen = torch.Generator().manual_seed(0)
    batch = build_thd_batch(
        [Sample(tokens=p + c, prompt_len=len(p), advantage=float(torch.randn(1, generator=gen))) for p, c, _ in seqs]
    )
    for _ in range(3):
        policy.train_step([batch], denominator=float(batch.loss_mask.sum()))
    result["before_sync"] = max_err(policy, sampled_sequences(engine, 3))
    stats = engine.load_weights(list(policy.hf_state_dict().items()))
    result["after_sync"] = max_err(policy, sampled_sequences(engine, 4))
    result["sync_seconds"] = stats["seconds"]
    engine.close()
    return result


def main():
    initialize_parallel(1, 1, seed=0)
    print("RESULT " + json.dumps({hf_dir: check(hf_dir) for hf_dir in sys.argv[1:] or [HF_DIR]}))


if __name__ == "__main__":
    main()
