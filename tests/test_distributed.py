"""Host-side collectives (megatron_dppo/run/collectives.py) and gradients gathered under the
distributed optimizer (MegatronPolicy.hf_grads), in torchrun workers over gloo.

This file is also the worker: `python tests/test_distributed.py --case NAME` under torchrun.
  collectives         every helper returns the right values in rank order over gloo, with its
                      tensors on the CPU; then the same calls as the NCCL path makes them (the
                      backend query answers "nccl", tests/dist_convert/fake_cuda.py stands in for
                      the GPU): every tensor a collective receives must be "on the GPU".
  dist-optimizer      DP=2 with use_distributed_optimizer=True: hf_grads equals a single-process
                      HF reference and the DDP all-reduce run; the raw main_grad (what hf_grads
                      returned before) does not; one optimizer step gives the same weights.
"""

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dist_convert"))


# ---------------------------------------------------------------------------------- the tests
def test_one_process_fallback():
    from megatron_dppo.run import collectives as D

    assert not dist.is_initialized()
    assert D.world() == (0, 1) and D.backend() is None and D.collective_device() == torch.device("cpu")
    assert D.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert D.broadcast_object([1, 2]) == [1, 2]
    assert D.agree(True) is True and D.agree(0) is False
    assert D.all_reduce_sum([1, 2.5]) == [1.0, 2.5] and D.all_reduce_max([3]) == [3.0]


def test_collectives_gloo_and_as_on_nccl(launch):
    res = launch(__file__, 2, "--case", "collectives")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "COLLECTIVES OK gloo" in res.stdout and "COLLECTIVES OK nccl-placement" in res.stdout


def test_hf_grads_with_distributed_optimizer_dp2(launch):
    res = launch(__file__, 2, "--case", "dist-optimizer")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "DIST OPTIMIZER GRADS OK" in res.stdout, res.stdout[-3000:]


def test_every_group_gets_parallel_timeout_minutes(launch):
    """Issue 22.5: the world, every Megatron group (gloo ones included, and the expert
    data-parallel gloo group Megatron itself creates without its timeout) run under
    parallel.timeout_minutes, read back from each group's backend (tests/dist/timeout_worker.py)."""
    res = launch(HERE / "dist" / "timeout_worker.py", 1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "timeouts OK on" in res.stdout


def test_vllm_timeout_kwargs_are_engine_args():
    """What the trainer hands RolloutEngine (-> vllm.LLM -> EngineArgs) for vLLM's groups; that
    they reach the groups is checked in tests/dist/vllm_tp_worker.py (test_vllm_engine.py)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from megatron_dppo.megatron.parallel import vllm_timeout_kwargs

    kwargs = vllm_timeout_kwargs(1.5)
    assert kwargs == {"distributed_timeout_seconds": 90, "cpu_distributed_timeout_seconds": 90}
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize(
    "environ, torch_version, want",
    [
        ({}, "2.13.0+cpu", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}),
        ({}, "2.6.0", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        # the user's choice wins, under either allocator variable
        ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "2.13.0", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "2.13.0", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
        ({"PYTORCH_ALLOC_CONF": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "2.13.0", {}),
    ],
)
def test_launch_env_defaults(monkeypatch, environ, torch_version, want):
    from megatron_dppo.run import collectives as D

    monkeypatch.setattr(torch, "__version__", torch_version)
    env = dict(environ)
    assert D.set_launch_env_defaults(env, cuda=True) == want
    assert env == {**environ, **want}
    assert D.set_launch_env_defaults(env, cuda=True) == {}  # idempotent
    assert D.set_launch_env_defaults({}, cuda=False) == {}  # nothing to do without CUDA


def test_launch_env_defaults_refuse_to_run_after_cuda_started(monkeypatch):
    from megatron_dppo.run import collectives as D

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="after CUDA was initialised, so CUDA_DEVICE_MAX_CONNECTIONS"):
        D.set_launch_env_defaults({}, cuda=True)
    done = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_ALLOC_CONF": "x"}
    assert D.set_launch_env_defaults(dict(done), cuda=True) == {}  # all set by the user: nothing to refuse


# -------------------------------------------------------------------------------- the workers
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


def _grad_check_helpers():
    path = HERE / "dist_step" / "grad_check.py"
    spec = importlib.util.spec_from_file_location("grad_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

    gc = _grad_check_helpers()
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
