"""Run Megatron-Core on a CPU-only PyTorch (gloo), for tests and the tiny CPU job.

Megatron-Core assumes CUDA everywhere. Each patch below was found necessary on CPU (removing
it breaks a forward, a PP step or a DDP + optimizer step with gradient clipping):
  - torch.cuda.current_device() is used as a device  -> returns the CPU device
  - device="cuda" literals, .cuda(), .to("cuda")      -> a TorchFunctionMode rewrites to CPU
  - tensor.type() == 'torch.cuda.FloatTensor' checks   -> the same mode reports CUDA type names
  - the CUDA RNG (seeding, RNG tracker)               -> the CPU generator
  - torch.cuda.synchronize / current_stream           -> no-ops
  - torch.cuda.Stream / Event (the MoE alltoall        -> stand-ins; record_event() returns an
    dispatcher's device-to-host side stream)              event whose synchronize() is a no-op
  - the alltoall dispatcher's split sizes             -> numpy arrays for CPU tensors too
    (maybe_move_tensor_to_cpu converts only CUDA tensors; all_to_all_single refuses tensors)
`enable_cpu_compat()` applies them once per process. It does nothing when CUDA is available.
`import_megatron_core()` (run by this package's __init__) imports Megatron-Core without
TorchInductor when there is no CUDA (see there).
`patch_moe_without_te()` (also needed on a GPU without Transformer Engine) defines the name
`te_general_gemm` that Megatron-Core's router gating reads but imports only with TE.

What the model config must do on CPU lives in model.py (all fusions off,
use_cpu_initialization=True). Scripts that save a dist checkpoint need an
`if __name__ == "__main__":` guard (it spawns a multiprocessing Manager).
"""

import contextlib
import sys

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

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def record_event(self, event=None):
        return event if event is not None else _CpuStream()  # the dispatcher synchronize()s it


def _split_sizes_to_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu for CPU tensors: the split sizes must reach
    all_to_all_single as numpy arrays (it refuses tensors), as they do from a GPU."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _compile_nothing(model=None, **kwargs):
    """torch.compile's signature, doing nothing (as decorator or call)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core() -> None:
    """Import megatron.core with its jit_fuser a no-op when there is no CUDA.

    megatron.core.jit sets `jit_fuser = torch.compile` and ~40 fused kernels are decorated with it
    at import; creating those compiled wrappers imports TorchDynamo and TorchInductor, ~4 of the
    ~7 s that importing Megatron-Core costs a process that has not imported vLLM (every torchrun
    worker of the conversion tools and the distributed tests). On CPU the model config turns every
    fusion off (model.py), so no wrapper would ever be called. Megatron's own switch,
    `megatron.core.jit.disable_jit_fuser()`, comes too late for the modules that megatron.core's
    __init__ imports, so torch.compile is a no-op only while that import runs, then restored and
    the switch thrown for later imports. With CUDA, or once megatron.core is imported, nothing
    changes. Idempotent."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    compile_ = torch.compile
    torch.compile = _compile_nothing
    try:
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = compile_


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
    # The MoE alltoall dispatcher copies its split sizes to the host on a side stream.
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuStream
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_numpy
    patch_moe_without_te()


def patch_moe_without_te() -> None:
    """Megatron-Core 0.16.1's router gating tests `te_general_gemm is not None`, a name
    moe_utils imports only when Transformer Engine does: define it as None without TE (a
    NameError otherwise, on CPU and on a GPU without TE alike). Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
