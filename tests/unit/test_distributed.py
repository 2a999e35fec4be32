"""The one-process side of megatron_dppo/run/collectives.py (the fallback without a process group)
and of the launch: vLLM's timeout keyword arguments, the launch environment's defaults. The
multi-process checks (collectives over gloo, the distributed optimizer's gradients, the groups'
timeouts): tests/dist/test_collectives.py."""

import pytest
import torch
import torch.distributed as dist


def test_one_process_fallback():
    from megatron_dppo.run import collectives as D

    assert not dist.is_initialized()
    assert D.world() == (0, 1) and D.backend() is None and D.collective_device() == torch.device("cpu")
    assert D.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert D.broadcast_object([1, 2]) == [1, 2]
    assert D.agree(True) is True and D.agree(0) is False
    assert D.all_reduce_sum([1, 2.5]) == [1.0, 2.5] and D.all_reduce_max([3]) == [3.0]


def test_vllm_timeout_kwargs_are_engine_args():
    """What the trainer hands RolloutEngine (-> vllm.LLM -> EngineArgs) for vLLM's groups; that
    they reach the groups is checked in tests/dist/workers/model/vllm_tp_worker.py (test_vllm_engine.py)."""
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
