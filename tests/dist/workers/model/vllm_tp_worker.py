"""torchrun --nproc_per_node 2 worker for tests/engine/test_vllm_engine.py: one RolloutEngine with
tensor_parallel_size=2 across both ranks, logprobs_mode="processed_logprobs".

Checks, on every rank: sampled tokens equal on both ranks (per-request seeds); log-probs equal
transformers' log_softmax(logits / T); after load_weights of new HF weights (every rank passes the
full tensors), the same against the new model; after close() the trainer's world still works;
vLLM's groups run under the timeout given (vllm_timeout_kwargs, parallel.timeout_minutes).
Rank 0 writes its measurements as JSON to --out. Any failed check raises (non-zero exit).
"""

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dppo.megatron.parallel import group_timeouts, vllm_timeout_kwargs
from megatron_dppo.rollout import RolloutEngine, hf_completion_logprobs

TEMPERATURE = 0.7
TIMEOUT_MINUTES = 7  # parallel.timeout_minutes reaches vLLM's groups (issue 22.5); torch's: 30 (gloo)


def check_against_hf(engine, hf_model, prompts, seed):
    out = engine.generate(prompts, n=2, max_new_tokens=16, temperature=TEMPERATURE, seed=seed)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, [[c.token_ids for c in r] for r in out])
    assert all(r == ranks[0] for r in ranks), "TP ranks sampled different tokens"
    flat = [(p, c) for p, r in zip(prompts, out) for c in r]
    ref = hf_completion_logprobs(hf_model, [p for p, _ in flat], [c.token_ids for _, c in flat], TEMPERATURE)
    return max((r - torch.tensor(c.logprobs)).abs().max().item() for r, (_, c) in zip(ref, flat))


def vllm_group_timeouts():
    """Timeouts of vLLM's own groups (device and gloo), read back from their backends."""
    from vllm.distributed import parallel_state as vllm_ps

    out = {}
    for name, ref in vllm_ps._groups.items():
        coordinator = ref()
        if coordinator is not None:
            for kind in ("device_group", "cpu_group"):
                out[f"{name}.{kind}"] = group_timeouts(getattr(coordinator, kind))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--new-model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # before the engine: vLLM reuses this world
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(args.new_model_dir, dtype=torch.float32).eval()
    engine = RolloutEngine(
        args.model_dir,
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        block_size=32,
        logprobs_mode="processed_logprobs",
        **vllm_timeout_kwargs(TIMEOUT_MINUTES),
    )
    result_timeouts = vllm_group_timeouts()
    want = {timedelta(minutes=TIMEOUT_MINUTES)}
    assert result_timeouts and all(t == want for t in result_timeouts.values()), result_timeouts
    prompts = [[4, 5, 13, 6, 16], list(range(3, 43))]
    result = {"init_seconds": engine.init_seconds}
    result["err_old"] = check_against_hf(engine, old, prompts, seed=1)

    t0 = time.perf_counter()
    stats = engine.load_weights(new.state_dict().items())
    result["load_seconds"] = time.perf_counter() - t0
    result["load_stats"] = stats
    result["err_new"] = check_against_hf(engine, new, prompts, seed=2)

    engine.close()
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the trainer's world survived vLLM's shutdown
    result["world_after_close"] = ones.item()
    for key, limit in (("err_old", 1e-4), ("err_new", 1e-4)):
        assert result[key] < limit, result
    assert result["world_after_close"] == dist.get_world_size(), result
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()  # every rank past its last collective before gloo is torn down (a teardown abort seen in CI)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
