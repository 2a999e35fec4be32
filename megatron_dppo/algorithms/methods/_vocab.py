"""Softmax statistics over a vocabulary split across tensor-parallel ranks, a chunk of positions
at a time, never gathering the vocabulary (the same scheme as megatron/logprobs.py's entropy).

Layout: `logits` [N, V_local] is this rank's contiguous slice of the output layer, as Megatron's
column-parallel head returns it: rank r of `group` holds vocabulary columns
[r * V_local, (r + 1) * V_local). `group` is the TP process group; None means no TP (the slice is
the whole vocabulary). `vocab_size` is the real vocabulary: Megatron pads the head to V_pad rows,
and the padding columns must take no probability mass (None: no padding).

Reductions over the vocabulary are all-reduces of [chunk] or [chunk, 1] tensors: max (no grad),
the softmax normaliser, and the statistic's own sum. Their backward passes differ, and must:
  - the statistic's final sum (`sum_over_ranks`) is consumed by a loss computed identically on
    every rank, so each rank's partial sum takes that gradient as is (identity backward, as
    Megatron's reduce_from_tensor_model_parallel_region);
  - the normaliser log Z (`log_softmax`) is consumed by each rank's OWN columns, so the gradient
    reaching it on one rank is only that rank's share: its backward all-reduces
    (torch.distributed.nn.functional.all_reduce). With an identity backward there, every rank
    would miss the other ranks' columns' pull on Z (measured: gradient errors of ~0.06 at TP=2).
Written here rather than taken from megatron.core.tensor_parallel because its reduce functions
use Megatron's global TP group only, and these pure rules take the group as an argument.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd

# Padding columns get this instead of -inf: exp() of it is exactly 0, and p * log p stays 0
# (not NaN) in values and in gradients, which -inf would break (0 * -inf).
PAD_LOGIT = -1e30


def rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: the loss that uses the sum is computed
    identically on every TP rank, so each rank's partial sum gets that loss's gradient as is
    (Megatron's reduce_from_tensor_model_parallel_region, with the group as an argument)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SumOverRanks.apply(x, group)


def max_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Elementwise max over the group, without gradient (used for numerical stability only)."""
    x = x.detach().clone()
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def scaled_logits(logits: torch.Tensor, *, vocab_size: int | None, group, temperature: float = 1.0) -> torch.Tensor:
    """logits / temperature in fp32 (fp64 stays fp64), padding columns at PAD_LOGIT (always a new tensor)."""
    z = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    part = z.shape[-1]
    start = rank_and_size(group)[0] * part
    if vocab_size is not None and start + part > vocab_size:
        padding = torch.arange(start, start + part, device=z.device) >= vocab_size
        z = z.masked_fill(padding, PAD_LOGIT)
    return z


def log_softmax(z: torch.Tensor, group) -> torch.Tensor:
    """Vocab-parallel log_softmax of z [n, V_local] -> this rank's slice [n, V_local],
    differentiable. Use the result only in per-column terms that are then summed with
    `sum_over_ranks` (see the module docstring: the normaliser's backward all-reduces)."""
    zmax = max_over_ranks(z.max(dim=-1, keepdim=True).values, group)
    sum_exp = torch.exp(z - zmax).sum(dim=-1, keepdim=True)
    if group is not None:
        sum_exp = dist_autograd.all_reduce(sum_exp, group=group)
    return z - zmax - torch.log(sum_exp)


def select_columns(x: torch.Tensor, index: torch.Tensor, group) -> torch.Tensor:
    """x[n, index[n]] for global vocabulary indices [n], whichever rank holds the column
    (differentiable): each rank contributes its own columns and 0 for the others."""
    part = x.shape[-1]
    start = rank_and_size(group)[0] * part
    local = index.long() - start
    here = (local >= 0) & (local < part)
    picked = x.gather(-1, local.clamp(0, part - 1)[:, None])[:, 0]
    return sum_over_ranks(torch.where(here, picked, torch.zeros_like(picked)), group)


def topk_threshold(z: torch.Tensor, k: int, group) -> torch.Tensor:
    """The k-th largest value of each row over the whole vocabulary, [n, 1] (no grad): each rank's
    local top-k are all-gathered and the global top-k taken from them."""
    z = z.detach()
    local = z.topk(min(k, z.shape[-1]), dim=-1).values
    if group is not None:
        parts = [torch.empty_like(local) for _ in range(rank_and_size(group)[1])]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=-1)
    return local.topk(min(k, local.shape[-1]), dim=-1).values[:, -1:]


def chunks(n: int, size: int):
    """slice objects covering range(n), `size` positions each."""
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {size}")
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
