"""Run Megatron-Core on a CPU-only PyTorch (gloo), for tests and the tiny CPU job.

Megatron-Core assumes CUDA everywhere. Each patch below was found necessary on CPU (removing
it breaks a forward, a PP step or a DDP + optimizer step with gradient clipping):
  - torch.cuda.current_device() is used as a device  -> returns the CPU device
  - device="cuda" literals, .cuda(), .to("cuda")      -> a TorchFunctionMode rewrites to CPU
  - tensor.type() == 'torch.cuda.FloatTensor' checks   -> the same mode reports CUDA type names
  - the CUDA RNG (seeding, RNG tracker)               -> the CPU generator
  - torch.cuda.synchronize / current_stream           -> no-ops
`enable_cpu_compat()` applies them once per process. It does nothing when CUDA is available.

What the model config must do on CPU lives in model.py (all fusions off,
use_cpu_initialization=True). Scripts that save a dist checkpoint need an
`if __name__ == "__main__":` guard (it spawns a multiprocessing Manager).
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_MODE = None  # the _CudaToCpu mode once enabled (entered per thread)


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
    """Patch torch.cuda / Megatron-Core so they run on the CPU. Idempotent; no-op with CUDA.
    The device-rewriting mode is per thread (torch keeps the mode stack in thread-local
    state): call this again in any other thread that runs Megatron code."""
    global _MODE
    if torch.cuda.is_available():
        return
    if _MODE is None:
        _patch_torch_cuda()
        _MODE = _CudaToCpu()
    from torch.overrides import _get_current_function_mode_stack

    if _MODE not in _get_current_function_mode_stack():
        _MODE.__enter__()


def _patch_torch_cuda() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    # Megatron passes torch.cuda.current_device() as a device (rotary, buffers, p2p).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # The CUDA RNG (model_parallel_cuda_manual_seed, the RNG tracker that forks dropout and
    # initialisation streams) maps onto the CPU generator.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # Pipeline p2p calls torch.cuda.synchronize() after its sends/receives; Megatron-Core
    # 0.19's DDP waits on torch.cuda.current_stream().
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _CpuStream()


@contextlib.contextmanager
def suspend_cpu_compat():
    """Temporarily leave the device-rewriting mode in this thread (it slows vLLM generation
    ~20-30%). The torch.cuda patches stay; only the per-call TorchFunctionMode is lifted."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if _MODE is None or _get_current_function_mode() is not _MODE:
        yield  # not enabled (or another mode sits above ours): nothing to lift safely
        return
    with _pop_mode_temporarily():
        yield
