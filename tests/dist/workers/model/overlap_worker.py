"""DP=2 worker for tests/dist/test_gpu_defaults_overlap.py: parallel.overlap_grad_reduce (DDP's per-bucket
reduce during the backward, the other micro-batches under no_sync) against the one reduce after
the backward (from the second iteration on, when Megatron starts overlapping), with small buckets
(several per model) and with the distributed optimizer off and on: the same reduced gradients, and the
same weights after a step."""

import sys
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # tests/: shared_helpers
from shared_helpers import load_tool  # noqa: E402

gc = load_tool(HERE.parent / "step" / "grad_check.py")

import megatron_dppo.megatron  # noqa: E402, F401  (before megatron.core: imports it without TorchInductor on CPU)

# isort: split
from megatron.core import parallel_state as ps  # noqa: E402

from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.model import GpuSettings  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402


def main():
    initialize_parallel(1, 1, seed=0)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg, model = gc.hf_model()
    hf_sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    loss_cfg = AlgorithmConfig(loss_agg="token-mean", clip_high=0.28)
    samples, lengths, w_q = gc.make_problem(model, 0.5, 0.5, seed=7)[:3]
    denom = losses.full_batch_denominator(
        loss_cfg.loss_agg,
        num_prompts=gc.B,
        group_size=gc.G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=gc.MAX_NEW,
    )
    mbs = gc.my_microbatches(samples, 24, dp_rank, dp_size)
    assert len(mbs) >= 2, len(mbs)  # no_sync must cover the first micro-batches
    for dist_opt in (False, True):
        runs = {}
        for overlap in (False, True):
            gpu = GpuSettings(overlap_grad_reduce=overlap, ddp_bucket_size=20_000 if overlap else 0)
            policy = MegatronPolicy(
                cfg, OptimConfig(lr=1e-2), loss_cfg, distributed_optimizer=dist_opt, gpu_settings=gpu
            )
            assert policy.model.ddp_config.overlap_grad_reduce is overlap
            if overlap:
                buckets = sum(len(b.buckets) for b in policy.model.bucket_groups)
                assert buckets > 1, buckets
            policy.load_hf_state_dict(hf_sd)
            # Megatron 0.16 learns each bucket's gradient count in the first iteration and reduces
            # it after the backward; only from the second on is a bucket reduced during it.
            for _ in range(2):
                policy.forward_backward(mbs, denom)
                grads = policy.hf_grads()
                assert policy.optimizer_step()["update_ok"]
            if overlap:
                assert not any(g.is_first_batch for g in policy.model.bucket_groups)
            runs[overlap] = grads, policy.hf_state_dict()
        (g0, w0), (g1, w1) = runs[False], runs[True]
        err_g = max(float((g1[k] - g0[k]).abs().max()) for k in g0)
        err_w = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
        scale = max(float(g.abs().max()) for g in g0.values())
        print(
            f"rank {dp_rank} dist_opt={dist_opt}: overlap vs not: "
            f"grad {err_g:.1e} (max |g| {scale:.1e}), weights {err_w:.1e}"
        )
        assert scale > 0 and err_g <= 1e-6 * scale and err_w <= 1e-5, (err_g, err_w)
    if dist.get_rank() == 0:
        print("OVERLAP GRAD REDUCE OK", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
