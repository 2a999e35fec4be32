"""DPPO pruning (DPPO.md sections 2, 3, 5) and the baseline strategies, in one registry.

Both DPPO levels use the same Horvitz-Thompson machinery: a candidate set C (the
low-information members), a FIXED count m = floor(r * |C|) of them dropped uniformly at
random, and the survivors of C reweighted by |C| / (|C| - m). Every member then has
E[weight * 1{kept}] = 1, so any loss that is a fixed-weight sum over members keeps its
expectation (and its gradient's) equal to the full batch's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_dppo.algorithms._checks import check_group_tensor, check_ratio

# |A| <= mean|A| compared with a relative tolerance so exact ties (binary rewards at success
# rate 1/2 make every |A| equal, and the float mean can land a hair below) are candidates.
_REL_TOL = 1e-6
_ABS_TOL = 1e-12
# r * |C| computed in floats can land a hair below an integer (0.29 * 100 = 28.999...).
_FLOOR_SLACK = 1e-9


def _is_low(values: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return values <= mean * (1 + _REL_TOL) + _ABS_TOL


def _drop_count(ratio: float, num_candidates: torch.Tensor) -> torch.Tensor:
    m = torch.floor(ratio * num_candidates.double() + _FLOOR_SLACK).long()
    # ratio < 1 keeps at least one candidate, so the weight |C| / (|C| - m) stays finite.
    return torch.minimum(m, (num_candidates - 1).clamp(min=0))


def _drop_uniformly(candidates: torch.Tensor, ratio: float, generator: torch.Generator | None):
    """candidates bool [R, N] -> (keep bool [R, N], weight float [R, N]).

    Drops exactly floor(ratio * |C_r|) candidates of each row, uniformly at random.
    """
    num_cand = candidates.sum(dim=1)
    drop_n = _drop_count(ratio, num_cand)
    # A uniformly random order of each row's candidates: random keys, non-candidates last.
    keys = torch.rand(candidates.shape, generator=generator, dtype=torch.float64)
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))
    rank = keys.argsort(dim=1).argsort(dim=1)
    dropped = candidates & (rank < drop_n[:, None])
    keep = ~dropped
    survivor_w = num_cand.double() / (num_cand - drop_n).clamp(min=1).double()
    weight = torch.where(candidates, survivor_w[:, None].expand_as(keys), torch.ones_like(keys))
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    return keep, weight.float()


def completion_candidates(advantages: torch.Tensor, rule: str = "low") -> torch.Tensor:
    """Bool [num_prompts, G]: |A| <= group mean |A| ("low", DPPO) or > ("high", reverse)."""
    if rule not in ("low", "high"):
        raise ValueError(f"rule must be 'low' or 'high', got {rule!r}")
    abs_adv = advantages.abs().double()
    low = _is_low(abs_adv, abs_adv.mean(dim=1, keepdim=True))
    return low if rule == "low" else ~low


def prune_completions(advantages: torch.Tensor, ratio: float, generator: torch.Generator | None = None,
                      rule: str = "low"):
    """DPPO completion-level pruning (after rollout, on the full group's advantages).

    advantages float [num_prompts, G] -> keep bool [num_prompts, G], weight float
    [num_prompts, G] (0 where dropped, |C|/(|C|-m) for kept candidates, 1 otherwise).
    """
    check_group_tensor("advantages", advantages)
    ratio = check_ratio("ratio", ratio)
    return _drop_uniformly(completion_candidates(advantages, rule), ratio, generator)


def _check_scores(scores: torch.Tensor) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 1-D tensor [num_prompts], got {shape}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor (NaN = no history), got dtype {scores.dtype}")
    if torch.isinf(scores).any():
        raise ValueError("scores must be finite or NaN (no history): found inf")
    return scores


def prompt_candidates(scores: torch.Tensor, rule: str = "low") -> torch.Tensor:
    """Bool [num_prompts]: prompts with a history whose score is <= (or > for "high") the
    mean score over prompts with a history. Prompts never seen (NaN) are never candidates."""
    if rule not in ("low", "high"):
        raise ValueError(f"rule must be 'low' or 'high', got {rule!r}")
    seen = ~torch.isnan(scores)
    if not seen.any():
        return torch.zeros_like(seen)
    s = scores.double()
    mean = s[seen].mean()
    low = _is_low(torch.where(seen, s, torch.zeros_like(s)), mean)
    return seen & (low if rule == "low" else ~low)


def prune_prompts(scores: torch.Tensor, ratio: float, generator: torch.Generator | None = None,
                  rule: str = "low"):
    """DPPO prompt-level pruning (before rollout: skipped prompts are never generated).

    scores float [num_prompts] (history score H(q), NaN for no history) -> keep bool
    [num_prompts], weight float [num_prompts] (0 skipped, |P|/(|P|-k) kept candidates, else 1).
    """
    _check_scores(scores)
    ratio = check_ratio("ratio", ratio)
    keep, weight = _drop_uniformly(prompt_candidates(scores, rule)[None, :], ratio, generator)
    return keep[0], weight[0]


def drop_zero_variance_groups(advantages: torch.Tensor):
    """Bool [num_prompts]: groups whose advantages are not all zero.

    With no KL term a zero-variance group's loss and gradient are exactly zero, so removing it
    changes nothing (unlike pruning, it needs no reweighting)."""
    check_group_tensor("advantages", advantages)
    return (advantages != 0).any(dim=1)


# ---------------------------------------------------------------------------------------------
# Strategy registry: what each method does at the two pruning points of a step.


@dataclass
class PromptStats:
    """The history store's view of one batch of prompts."""
    score: torch.Tensor            # float [P]; NaN = never rolled out
    zero_var_streak: torch.Tensor  # long [P]; consecutive zero-variance rollouts up to now


def _keep_all_prompts(stats: PromptStats):
    n = stats.score.shape[0]
    return torch.ones(n, dtype=torch.bool), torch.ones(n)


def _keep_all_completions(advantages: torch.Tensor):
    check_group_tensor("advantages", advantages)
    return torch.ones_like(advantages, dtype=torch.bool), torch.ones_like(advantages)


class NoPruning:
    """GRPO (and DAPO/GSPO/Dr.GRPO): every prompt is rolled out, every completion trained."""
    unbiased = True

    def prune_prompts(self, stats, ratio, generator=None):
        return _keep_all_prompts(stats)

    def prune_completions(self, advantages, ratio, generator=None):
        return _keep_all_completions(advantages)


class DPPO:
    """Unbiased dynamic pruning: low-information prompts and low-|A| completions, reweighted.
    rule="high" is the reverse ablation (prune the informative ones instead)."""
    unbiased = True

    def __init__(self, rule: str = "low"):
        self.rule = rule

    def prune_prompts(self, stats, ratio, generator=None):
        return prune_prompts(stats.score, ratio, generator, rule=self.rule)

    def prune_completions(self, advantages, ratio, generator=None):
        return prune_completions(advantages, ratio, generator, rule=self.rule)


class CPPO:
    """CPPO baseline: keep the top G - floor(G * ratio) completions of each group by |A|,
    with no reweighting (so the loss is biased towards high-|A| completions)."""
    unbiased = False

    def prune_prompts(self, stats, ratio, generator=None):
        return _keep_all_prompts(stats)

    def prune_completions(self, advantages, ratio, generator=None):
        check_group_tensor("advantages", advantages)
        ratio = check_ratio("ratio", ratio)
        g = advantages.shape[1]
        n_keep = max(1, g - math.floor(g * ratio + _FLOOR_SLACK))
        # Stable sort on -|A| so ties are broken by position, deterministically.
        order = torch.sort(-advantages.abs(), dim=1, stable=True).indices
        keep = torch.zeros_like(advantages, dtype=torch.bool)
        keep.scatter_(1, order[:, :n_keep], True)
        return keep, keep.float()


class GRESO:
    """GRESO baseline: skip a prompt whose last z rollouts in a row had zero reward variance
    with probability 1 - (1 - ratio)^z (grows with z), no reweighting; completions untouched."""
    unbiased = False

    def prune_prompts(self, stats, ratio, generator=None):
        ratio = check_ratio("ratio", ratio)
        z = stats.zero_var_streak.double()
        p_skip = 1.0 - (1.0 - ratio) ** z
        u = torch.rand(z.shape, generator=generator, dtype=torch.float64)
        keep = u >= p_skip
        return keep, keep.float()

    def prune_completions(self, advantages, ratio, generator=None):
        return _keep_all_completions(advantages)


STRATEGIES = {
    "none": NoPruning,
    "dppo": DPPO,
    "reverse": lambda: DPPO(rule="high"),
    "cppo": CPPO,
    "greso": GRESO,
}


def get_strategy(name: str):
    if name not in STRATEGIES:
        raise ValueError(f"pruning strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]()
