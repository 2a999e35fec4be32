"""Host-side collectives (python values, not model tensors) that work on gloo and on NCCL.

The trainer exchanges small host values between ranks: rank 0's stop decision, rolled-out token
ids, rewards, metric sums. NCCL has no CPU path: a tensor collective on a CPU tensor fails
there ("No backend type associated with device type cpu"), while gloo accepts it, so code
tested on gloo alone can die at the first collective on GPUs. Here:
  * python objects go through torch's object collectives, which stage their bytes on the
    current CUDA device themselves when the backend is NCCL (that needs
    torch.cuda.set_device(local rank), which megatron/parallel.py does);
  * number vectors go through one tensor collective on `collective_device()`: the current CUDA
    device when the group's backend is NCCL, the CPU otherwise.
Every function is also correct without torch.distributed (or in a 1-process world): it returns
what a 1-rank collective would. All are collective over `group` (default: the world): every
rank must call them in the same order.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from packaging.version import Version


def world(group=None) -> tuple[int, int]:
    """(rank, size) in group; (0, 1) without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def barrier(group=None) -> None:
    """Wait for every rank of group; nothing without torch.distributed."""
    if dist.is_initialized():
        dist.barrier(group)


def backend(group=None) -> str | None:
    """The group's backend name ("gloo", "nccl", ...); None without torch.distributed."""
    return str(dist.get_backend(group)) if dist.is_initialized() else None


def collective_device(group=None) -> torch.device:
    """Where a tensor must live for a collective over group: NCCL only moves CUDA tensors."""
    if backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_objects(obj, group=None) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (picklable objects)."""
    _, size = world(group)
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """src's obj on every rank (src is a global rank, as in torch.distributed)."""
    if world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(flag: bool, group=None) -> bool:
    """Rank 0's flag on every rank: one decision where ranks may see slightly different facts
    (wall-clock budgets, a signal that reached one rank first)."""
    if world(group)[1] == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=collective_device(group))
    dist.broadcast(t, src=0, group=group)
    return bool(t.item())


def _all_reduce(values, op, group) -> list[float]:
    values = [float(v) for v in values]
    if world(group)[1] == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sum(values, group=None) -> list[float]:
    """Element-wise sum over ranks of a list of numbers (float64: exact for counts < 2**53)."""
    return _all_reduce(values, dist.ReduceOp.SUM, group)


def all_reduce_max(values, group=None) -> list[float]:
    """Element-wise max over ranks of a list of numbers."""
    return _all_reduce(values, dist.ReduceOp.MAX, group)


# ---- the launch environment (read by CUDA and torch's allocator when CUDA starts) ----------------
def _alloc_conf_names() -> tuple[str, ...]:
    """The allocator-config variables torch reads, the one it prefers first: PYTORCH_ALLOC_CONF
    since torch 2.9 (PYTORCH_CUDA_ALLOC_CONF still read, deprecated), only the CUDA one before.
    (No attribute tells them apart, so the version does.)"""
    if Version(torch.__version__).release >= (2, 9):
        return ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    return ("PYTORCH_CUDA_ALLOC_CONF",)


def launch_env_defaults() -> list[tuple[tuple[str, ...], str]]:
    """(variables, value): the value is the default unless one of the variables is set (the first
    is the one set)."""
    return [
        # One hardware queue per device: Megatron's TP communication overlap and its
        # sequence-parallel output layer rely on kernels being issued in program order.
        (("CUDA_DEVICE_MAX_CONNECTIONS",), "1"),
        # Packs of varying length fragment the caching allocator; vLLM's sleep-mode pool turns
        # expandable segments off around itself (vllm/device_allocator/cumem.py).
        (_alloc_conf_names(), "expandable_segments:True"),
    ]


def set_launch_env_defaults(environ=None, *, cuda: bool | None = None) -> dict[str, str]:
    """On a CUDA machine (cuda None: torch.cuda.is_available(), which starts no CUDA context),
    set CUDA_DEVICE_MAX_CONNECTIONS=1 and expandable allocator segments unless the user set them
    (either allocator variable counts); returns what it set. Both are read when CUDA starts, so
    setting one after that is a RuntimeError (it would silently do nothing). Call it first thing
    in the process: child processes (vLLM, reward workers) inherit the environment."""
    env = os.environ if environ is None else environ
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return {}
    wanted = {names[0]: value for names, value in launch_env_defaults() if not any(n in env for n in names)}
    if wanted and torch.cuda.is_initialized():
        raise RuntimeError(
            f"set_launch_env_defaults() ran after CUDA was initialised, so {', '.join(wanted)} would "
            "have no effect: call it before anything touches the GPU (or set them in the environment)"
        )
    env.update(wanted)
    return wanted
