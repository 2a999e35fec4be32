"""Group-relative advantages, computed on the FULL group before any completion is pruned."""

from typing import get_args

import torch

from megatron_dppo.algorithms._checks import check_group_tensor
from megatron_dppo.algorithms.choices import AdvantageKind

ADVANTAGE_KINDS = get_args(AdvantageKind)


def group_advantages(rewards: torch.Tensor, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_prompts, G] -> advantages [num_prompts, G].

    grpo:   (r - mean) / (std + eps), std with Bessel's correction (as verl and TRL do)
    drgrpo: r - mean (Dr.GRPO drops the std: it up-weights easy/hard prompts otherwise)
    A zero-variance group gets all-zero advantages under both.
    """
    check_group_tensor("rewards", rewards)
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"kind must be one of {ADVANTAGE_KINDS}, got {kind!r}")
    rewards = rewards.double()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if kind == "drgrpo":
        return centered.float()
    std = rewards.std(dim=1, keepdim=True)
    return (centered / (std + eps)).float()


def group_reward_std(rewards: torch.Tensor) -> torch.Tensor:
    """Per-group reward std [num_prompts]: the history score DPPO prunes prompts by."""
    check_group_tensor("rewards", rewards)
    return rewards.double().std(dim=1).float()
