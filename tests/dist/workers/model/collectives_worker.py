"""torchrun --nproc_per_node 2 tests/dist/workers/model/collectives_worker.py --case NAME
(tests/dist/test_collectives.py runs it):
  collectives         every helper of megatron_dppo/run/collectives.py returns the right values in
                      rank order over gloo, with its tensors on the CPU; then the same calls as the
                      NCCL path makes them (the backend query answers "nccl",
                      tests/dist/workers/convert/fake_cuda.py stands in for the GPU): every tensor a
                      collective receives must be "on the GPU".
  dist-optimizer      DP=2 with use_distributed_optimizer=True: hf_grads equals a single-process
                      HF reference and the DDP all-reduce run; the raw main_grad (what hf_grads
                      returned before) does not; one optimizer step gives the same weights.
"""

import argparse
import math
import sys
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "convert"))
sys.path.insert(0, str(HERE.parents[2]))  # tests/: shared_helpers
from shared_helpers import load_tool  # noqa: E402


def _collectives():
    from fake_cuda import FakeCuda, on_fake_cuda

    from megatron_dppo.run import collectives as D

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    received = []  # (collective, tensor is "on the GPU", device)

    def spy(name, real):
        def call(tensor, *args, **kwargs):
            received.append((name, on_fake_cuda(tensor), tensor.device))
            return real(tensor, *args, **kwargs)

        return call

    dist.broadcast = spy("broadcast", dist.broadcast)
    dist.all_reduce = spy("all_reduce", dist.all_reduce)

    def check_values():
        assert D.all_gather_objects({"rank": rank}) == [{"rank": r} for r in range(size)]
        assert D.broadcast_object(f"from {rank}") == "from 0"
        assert D.broadcast_object(f"from {rank}", src=1) == "from 1"
        assert D.agree(rank == 0) is True and D.agree(rank != 0) is False  # rank 0 decides
        assert D.all_reduce_sum([rank, 1.5]) == [sum(range(size)), 1.5 * size]
        assert D.all_reduce_max([rank, -rank]) == [size - 1, 0]

    check_values()
    assert received and all(not gpu and dev.type == "cpu" for _, gpu, dev in received), received
    print("COLLECTIVES OK gloo", flush=True)

    received.clear()
    D.backend = lambda group=None: "nccl"  # what the trainer's world reports on GPUs
    with FakeCuda():
        check_values()
    assert {name for name, _, _ in received} == {"broadcast", "all_reduce"}, received
    cpu = [name for name, gpu, _ in received if not gpu]
    assert not cpu, f"tensor collectives on CPU tensors under NCCL: {cpu}"
    print("COLLECTIVES OK nccl-placement", flush=True)
    dist.destroy_process_group()


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return math.sqrt(num / den)


def _dist_optimizer():
    from megatron.core import parallel_state as ps

    from megatron_dppo.algorithms import losses
    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron import destroy_parallel, initialize_parallel
    from megatron_dppo.megatron.policy import MegatronPolicy

    gc = load_tool(HERE.parent / "step" / "grad_check.py")
    initialize_parallel(1, 1, seed=0)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    assert dp_size == 2
    cfg, model = gc.hf_model()
    hf_sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    loss_cfg = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_high=0.28)
    samples, lengths, w_q = gc.make_problem(model, 0.5, 0.5, seed=7)[:3]  # (later versions return more)
    denom = losses.full_batch_denominator(
        loss_cfg.loss_agg,
        num_prompts=gc.B,
        group_size=gc.G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=gc.MAX_NEW,
    )
    _, ref = gc.reference_grads(model, samples, loss_cfg, denom)
    mbs = gc.my_microbatches(samples, 24, dp_rank, dp_size)

    policies = {}
    for name, on in (("all-reduce", False), ("distributed-optimizer", True)):
        policy = MegatronPolicy(cfg, OptimConfig(lr=1e-2), loss_cfg, distributed_optimizer=on)
        assert policy.model.ddp_config.use_distributed_optimizer is on
        policy.load_hf_state_dict(hf_sd)
        policy.forward_backward(mbs, denom)
        policies[name] = policy
    plain, sharded = policies["all-reduce"], policies["distributed-optimizer"]

    raw = {k: p.main_grad.detach().clone() for k, p in sharded.model.module.named_parameters()}
    g_plain, g_sharded = plain.hf_grads(), sharded.hf_grads()
    keys = {k for k in ref if k != "lm_head.weight"}
    assert g_sharded.keys() == keys, sorted(g_sharded.keys() ^ keys)
    err_ref, err_plain = _rel(g_sharded, {k: ref[k] for k in keys}), _rel(g_sharded, g_plain)
    # Negative control: the reduce-scattered buffer read as is (the old hf_grads) is wrong.
    local_plain = {k: p.main_grad.detach() for k, p in plain.model.module.named_parameters()}
    err_raw = _rel(raw, local_plain)
    print(
        f"rank {dp_rank}: rel. error vs HF reference {err_ref:.2e}, vs all-reduce run {err_plain:.2e}, "
        f"raw main_grad vs all-reduce {err_raw:.2e}",
        flush=True,
    )
    assert err_ref < 1e-5 and err_plain < 1e-6, (err_ref, err_plain)
    assert err_raw > 1e-2, f"the raw main_grad already equals the reduced gradient ({err_raw}): the check shows nothing"

    # hf_grads must leave the buffers as the optimizer expects them: one step, same weights.
    for policy in (plain, sharded):
        assert policy.optimizer_step()["update_ok"]
    w_plain, w_sharded = plain.hf_state_dict(), sharded.hf_state_dict()
    moved = _rel({k: w_plain[k] for k in keys}, {k: hf_sd[k] for k in keys})
    assert moved > 1e-4, moved
    assert _rel(w_sharded, w_plain) < 1e-6, _rel(w_sharded, w_plain)
    if dist.get_rank() == 0:
        print("DIST OPTIMIZER GRADS OK", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=["collectives", "dist-optimizer"])
    case = ap.parse_args().case
    {"collectives": _collectives, "dist-optimizer": _dist_optimizer}[case]()
