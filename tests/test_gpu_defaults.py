"""GPU-only settings that must resolve to today's behaviour on this CPU, checked against the
libraries' own names so a rename upstream fails here rather than on a lent GPU."""

import dataclasses

from megatron_dppo.rollout import vllm_engine


def test_sleeping_gpu_engines_release_cuda_graphs_and_nccl_buffers():
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(vllm_engine.GPU_SLEEP_RELEASE) <= fields, set(vllm_engine.GPU_SLEEP_RELEASE) - fields
    assert vllm_engine.sleep_release_kwargs(True, True, {"block_size": 16}) == {
        "sleep_mode_offload_cudagraph": True,
        "enable_nccl_comm_suspend": True,
        "block_size": 16,
    }
    # the caller's own choice wins; a CPU engine or one that never sleeps gets nothing added
    assert vllm_engine.sleep_release_kwargs(True, True, {"enable_nccl_comm_suspend": False})[
        "enable_nccl_comm_suspend"
    ] is False
    assert vllm_engine.sleep_release_kwargs(False, True, {}) == {}
    assert vllm_engine.sleep_release_kwargs(True, False, {}) == {}
