"""Process groups: torch.distributed + Megatron-Core parallel state (what must divide what is
config/layout.py's, checked before anything is built)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_dppo.megatron.cpu_compat import enable_cpu_compat

DEFAULT_TIMEOUT_MINUTES = 60.0  # parallel.timeout_minutes


def initialize_parallel(
    tp: int = 1,
    pp: int = 1,
    seed: int = 0,
    *,
    ep: int = 1,
    etp: int = 1,
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
) -> None:
    """Start torch.distributed if needed (nccl on GPU, gloo on CPU; env:// under torchrun, a
    1-process world otherwise), then Megatron's TP/PP/DP groups (and the expert groups: EP x
    expert-TP x expert-DP x PP over the same world) and its RNG streams (every rank seeded
    alike). On CPU the CUDA shim is enabled first.

    Every group (the world, Megatron's NCCL and gloo groups) gets `timeout_minutes`
    (parallel.timeout_minutes): torch's defaults, 10 minutes for NCCL and 30 for gloo, are
    shorter than waits that are long by design (engines of different speed meeting in the
    rollout gather, HF loading before the first all-reduce, rank 0 pruning checkpoints).
    vLLM's own groups get it through vllm_timeout_kwargs."""
    enable_cpu_compat()
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:  # launched by torchrun (env://)
            dist.init_process_group(backend, timeout=timeout)
        else:  # a plain process: a 1-rank world with an in-memory store (no port to clash)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if dist.get_world_size() % (tp * pp):
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp*pp = {tp * pp}")
    if dist.get_world_size() % (ep * etp * pp):
        raise ValueError(
            f"world size {dist.get_world_size()} is not a multiple of ep*etp*pp = {ep}*{etp}*{pp} = {ep * etp * pp}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    # Megatron creates a few groups without its timeout (0.16-0.19: the expert data-parallel
    # gloo group), and a world made by the caller has torch's default: set it on all of them.
    set_timeout_on_all_groups(timeout)
    torch.manual_seed(seed)
    # Default/TP/expert RNG streams; on CPU (shim) this also seeds the CPU generator, which
    # use_cpu_initialization draws the master weights from: identical on every rank.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def vllm_timeout_kwargs(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> dict:
    """vllm.LLM keyword arguments (RolloutEngine passes them on) giving vLLM's device and gloo
    groups the same timeout; vLLM otherwise creates them with torch's defaults."""
    seconds = int(round(timeout_minutes * 60))
    return {"distributed_timeout_seconds": seconds, "cpu_distributed_timeout_seconds": seconds}


def _process_groups() -> list:
    """Every process group this rank belongs to (the world included). torch keeps them in a
    private registry; without it (another torch), just the world."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return list(registry) if registry is not None else [dist.group.WORLD]


def _backends(group) -> list:
    found = []
    for device in ("cpu", "cuda"):
        try:
            found.append(group._get_backend(torch.device(device)))
        except RuntimeError:  # the group has no backend for this device type
            pass
    return found


def group_timeouts(group) -> set[timedelta]:
    """The timeouts a group's backends (gloo for CPU tensors, NCCL for CUDA ones) run under."""
    return {b.options._timeout for b in _backends(group) if hasattr(b, "options")}


def set_timeout_on_all_groups(timeout: timedelta) -> None:
    """Give every group of this rank `timeout` (torch's _set_pg_timeout, where it exists)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    for group in _process_groups():
        if group_timeouts(group) != {timeout}:
            set_timeout(timeout, group)


def data_parallel_rank_and_size() -> tuple[int, int]:
    """This rank's data-parallel index and the DP size (packs are spread over DP ranks)."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def destroy_parallel(world: bool = True) -> None:
    """Tear down Megatron's groups, and the torch.distributed world unless world=False
    (keep it to re-initialise another layout, or when vLLM shares the world)."""
    parallel_state.destroy_model_parallel()
    if world and dist.is_initialized():
        dist.destroy_process_group()
