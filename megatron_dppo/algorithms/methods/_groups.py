"""Which completions of a group are correct, which groups are mixed, and the per-group
shortest / longest pick BPPO and SSOPD share. Ties always go to the lowest completion index (our
choice): completions are i.i.d., so that is a uniform tie-break, and it is layout independent.

"Correct" is reward >= correct_threshold (0.5: our choice), so binary 0/1 rewards, and rewards
like GRESO's 0.1 for a wrong answer, classify as docs/methods.md's r_i in {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dppo.algorithms._checks import check_group_tensor

CORRECT_THRESHOLD = 0.5


def correct_mask(rewards: torch.Tensor, threshold: float = CORRECT_THRESHOLD) -> torch.Tensor:
    """rewards [P, G] -> bool [P, G]."""
    check_group_tensor("rewards", rewards)
    return rewards >= threshold


def check_lengths(lengths: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """lengths [P, G] of integers >= 0 (completion tokens, EOS included) -> int64."""
    if not isinstance(lengths, torch.Tensor) or lengths.shape != shape:
        got = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be a tensor of shape {tuple(shape)} (as rewards), got {got}")
    if lengths.is_floating_point() or (lengths < 0).any():
        raise ValueError("lengths must be non-negative integers (completion tokens)")
    return lengths.long()


def pick(lengths: torch.Tensor, allowed: torch.Tensor, longest: bool = False) -> torch.Tensor:
    """Per row, the index of the shortest (or longest) allowed completion, the lowest index among
    equal lengths; -1 where a row allows none. lengths [P, G] int, allowed [P, G] bool -> [P] int64."""
    g = lengths.shape[1]
    index = torch.arange(g, device=lengths.device).expand_as(lengths)
    # A unique key per completion orders by length, then by index (lowest first either way).
    key = lengths * g + (g - 1 - index if longest else index)
    if longest:
        chosen = key.masked_fill(~allowed, -1).argmax(dim=1)
    else:
        chosen = key.masked_fill(~allowed, torch.iinfo(torch.int64).max).argmin(dim=1)
    return torch.where(allowed.any(dim=1), chosen, torch.full_like(chosen, -1))


@dataclass(frozen=True)
class PairSelection:
    """One correct and one incorrect completion per group; -1 in both where there is none."""

    correct: torch.Tensor  # [P] int64, completion index in its group, or -1
    wrong: torch.Tensor  # [P] int64, or -1

    @property
    def selected(self) -> torch.Tensor:
        """[P] bool: the group has a pair."""
        return (self.correct >= 0) & (self.wrong >= 0)

    def masks(self, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(is_correct_pick, is_wrong_pick), each bool [P, group_size]."""
        return self._mask(self.correct, group_size), self._mask(self.wrong, group_size)

    def _mask(self, index: torch.Tensor, g: int) -> torch.Tensor:
        cols = torch.arange(g, device=index.device)
        return (cols[None, :] == index[:, None]) & self.selected[:, None]
