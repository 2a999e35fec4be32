"""A CPU stand-in for a CUDA device: tests of device placement on a machine without a GPU.

Inside `with FakeCuda():`
  * a tensor created with device="cuda" / "cuda:N" / torch.device("cuda", N) / an int ordinal,
    or moved there with .to(...) / .cuda(), is a CPU tensor tagged as living on the GPU;
  * an op on tagged tensors returns tagged tensors; an op mixing a tagged tensor with an
    untagged one raises the error CUDA raises ("Expected all tensors to be on the same device").
    As on CUDA, a 0-dim CPU tensor may join a GPU op (a scalar), not the reverse;
  * .cpu() / .to("cpu") return an untagged copy;
  * torch.cuda.current_device() returns 0.
`with fake.outside():` runs a block as plain CPU code again (e.g. the real model behind a
wrapper that stands for a GPU model). So code that forgets to move its inputs to the model's
device, or subtracts GPU logits from CPU ones, fails here as it would on a GPU;
`on_fake_cuda(t)` tells where a tensor "is".
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten

_TAG = "_on_fake_cuda"


def on_fake_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _TAG, False)


def _where(device):
    """'cuda', 'cpu' or None (not a device) for a device-like argument."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":")[0]
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"  # an ordinal means a CUDA device
    return None


def _cpu_if_device(x):
    return torch.device("cpu") if _where(x) == "cuda" else x


class FakeCuda(TorchFunctionMode):
    def __enter__(self):
        self._current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.current_device = self._current_device
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def outside(self):
        if _get_current_function_mode() is not self:
            raise RuntimeError("FakeCuda.outside() needs FakeCuda to be the innermost torch function mode")
        torch.cuda.current_device = self._current_device
        try:
            with _pop_mode_temporarily():
                yield
        finally:
            torch.cuda.current_device = lambda: 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = None  # where the result goes: "cuda", "cpu", or None (where the inputs are)
        if func is torch.Tensor.cuda:
            target, args = "cuda", args[:1]
        elif func is torch.Tensor.cpu:
            target = "cpu"
        if "device" in kwargs:
            target = _where(kwargs["device"]) or target
            kwargs["device"] = _cpu_if_device(kwargs["device"])
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    target = "cuda" if on_fake_cuda(a) else "cpu"
                elif _where(a):
                    target = _where(a)
            args = (args[0],) + tuple(_cpu_if_device(a) for a in args[1:])

        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if target is None:
            big = {on_fake_cuda(t) for t in tensors if t.dim() > 0}
            gpu_scalar = any(on_fake_cuda(t) for t in tensors if t.dim() == 0)
            if len(big) > 1 or (big == {False} and gpu_scalar):
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, cuda:0 and cpu! (FakeCuda, in {getattr(func, '__name__', func)})"
                )
            target = "cuda" if True in big or (not big and gpu_scalar) else None

        out = func(*args, **kwargs)
        if (
            target is not None
            and func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
            and out is args[0]
            and on_fake_cuda(out) != (target == "cuda")
        ):
            out = out.clone()  # a move to another device is a copy, never the same tensor
        if target is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    setattr(t, _TAG, target == "cuda")
        return out
