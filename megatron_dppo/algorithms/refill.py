"""Refilling a step's batch to B groups (DAPO dynamic sampling, GRESO), with prompt weights.

DAPO draws prompts, drops the zero-variance groups and draws more until B informative groups
are collected; the unpruned method then trains exactly the first B informative groups of the
prompt stream, each with weight 1. With DPPO prompt pruning a kept candidate prompt stands for
w_q prompts of the stream (itself and the skipped ones it represents, Horvitz-Thompson). So the
batch is full when the WEIGHTS of the collected groups reach B, not their count: counting
skipped prompts as both represented (w_q) and replaced (another draw) would double-count them.

`take_until_full` walks a round's groups in stream order and gives each the part of its weight
that still fits under the target; the group that crosses the target gets the remainder (a
fractional weight) and later ones 0. The trained batch's total weight is then exactly B
whenever refill succeeds, and the sum of what was collected when it falls short. A strategy
without reweighting (GRESO) passes weight 1 for kept prompts, so its skipped prompts are simply
replaced, as in its authors' code. docs/algorithm.md has the rule and why it is consistent.
"""

from __future__ import annotations


def take_until_full(weights, target: float, filled: float) -> list[float]:
    """weights: each candidate group's weight, in stream order; target: B; filled: the weight
    already collected in earlier rounds. Returns the weight each group is trained with
    (its weight, the remainder for the group that fills the batch, 0 after that)."""
    out = []
    for w in weights:
        w = float(w)
        if w < 0:
            raise ValueError(f"group weights must be >= 0, got {w}")
        room = max(float(target) - filled, 0.0)
        take = min(w, room)
        out.append(take)
        filled += take
    return out
