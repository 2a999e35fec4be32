"""Argument checks shared by the algorithm functions: each error names the argument."""

import math

import torch


def check_ratio(name: str, ratio: float) -> float:
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        or not math.isfinite(ratio)
        or not 0.0 <= ratio < 1.0
    ):
        raise ValueError(f"{name} must be a number in [0, 1), got {ratio!r}")
    return float(ratio)


def check_group_tensor(name: str, x: torch.Tensor) -> torch.Tensor:
    """A [num_prompts, G] float tensor of finite values with G >= 2."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [num_prompts, G], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [num_prompts, G], got shape {tuple(x.shape)}")
    if x.shape[1] < 2:
        raise ValueError(f"{name} must have G >= 2 completions per prompt, got G={x.shape[1]}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite: found NaN or inf")
    return x
