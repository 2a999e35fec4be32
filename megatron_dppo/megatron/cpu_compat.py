"""Run Megatron-Core on a CPU-only PyTorch (gloo), for tests and the tiny CPU job.

Megatron-Core assumes CUDA everywhere: `torch.cuda.current_device()` as a device, `device="cuda"`
literals, `.cuda()`, the CUDA RNG, and `tensor.type() == 'torch.cuda.FloatTensor'` checks.
`enable_cpu_compat()` redirects all of that to the CPU. It does nothing when CUDA is available.

What the model config must do on CPU lives in model.py (all fusions off,
use_cpu_initialization=True). Scripts that save a dist checkpoint need an
`if __name__ == "__main__":` guard (it spawns a multiprocessing Manager).
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_MODE = None  # the global _CudaToCpu mode once enabled


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _cpu(device):
    return torch.device("cpu") if _is_cuda(device) else device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call (100+ call sites in Megatron-Core:
    default causal masks, DDP grad buffers, optimizer state, p2p buffers, ...)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's grad clipping and mixed-precision optimizer check the type string.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            device = kwargs["device"]
            # An int device means a CUDA ordinal (torch.cuda.current_device() on a GPU build).
            kwargs["device"] = torch.device("cpu") if isinstance(device, int) else _cpu(device)
        # Positional devices: x.to("cuda"), x.to(torch.device("cuda")).
        args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for torch.cuda streams/events: everything on CPU is already ordered."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _cpu_rng_state(device=None, *args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def enable_cpu_compat() -> None:
    """Patch torch.cuda / Megatron-Core so they run on the CPU. Idempotent; no-op with CUDA."""
    global _MODE
    if torch.cuda.is_available() or _MODE is not None:
        return
    from megatron.core.tensor_parallel import random as mcore_random

    # 1. Megatron passes torch.cuda.current_device() as a device (rotary, buffers, p2p).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # 3. The CUDA RNG (model_parallel_cuda_manual_seed, the RNG tracker that forks dropout and
    # initialisation streams) maps onto the CPU generator.
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.manual_seed_all = torch.manual_seed
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # 5. Newer Megatron-Core (0.19) DDP synchronises with torch.cuda.current_stream().
    torch.cuda.current_stream = lambda *args, **kwargs: _CpuStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # 2 + 4. Device literals and type strings, globally (see _CudaToCpu).
    _MODE = _CudaToCpu()
    _MODE.__enter__()


@contextlib.contextmanager
def suspend_cpu_compat():
    """Temporarily leave the global device-rewriting mode (it slows vLLM generation ~20-30%).
    The torch.cuda patches stay; only the per-call TorchFunctionMode is lifted."""
    if _MODE is None:
        yield
        return
    from torch.overrides import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield
