"""BPPO, Binary Prefix Policy Optimization (docs/methods.md section 1), as pure rules.

Per mixed group (0 < k < G correct) the update unit is one pair [paper]: c = the shortest
correct completion and w = the shortest incorrect one, ties to the lowest index (our choice).
Only a prefix of each is trained [paper; how long is unknown, our choice below]. Advantages stay
those of the FULL group (algorithms/advantages.group_advantages on all G) [paper]. Non-mixed
groups select nothing. Every other completion gets weight 0: no log-prob pass, no backward.

How it plugs into the step's planning (algorithms/batch.py), before the log-prob pass, per
optimizer step (mini-batch) over its groups:
    plan = bppo.plan(verdicts, lengths, cfg, loss_agg=method.loss_agg, prompt_weight=train_weights)
    D = plan.denominator_terms   (a sum over groups: all-reduce it over DP only where each rank
                                  planned a share of the groups; compute it before the first micro-batch)
    completion i of group q: weight plan.seq_weight[q, i] (0 = not trained), trained tokens t < plan.prefix_len[q, i]
    coef = losses.token_coefficients(seq_index, seq_weight, prefix_len, loss_agg, D)
verdicts: [P, G] 1.0 / 0.0 from Group.correct() (shaped rewards, e.g. DAPO's overlong penalty,
could cross the 0.5 threshold). Passing prefix_len as token_coefficients' seq_length gives
seq-mean-token-mean its 1/P_i. With GSPO the sequence ratio is exp(mean over PREFIX tokens of
log rho) (our choice): give policy_loss only the prefix tokens (its segment mean then runs over them).

Biased by design (length-dependent, deterministic selection, suffixes deleted): verify-unbiased
lists it as biased like CPPO. Completion pruning is REPLACED by the selection: r_o > 0 with BPPO
is a config error (`check_no_completion_pruning`). Prompt pruning composes: w_q multiplies the
pair and enters the denominator (Horvitz-Thompson over prompts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_dppo.algorithms.methods._groups import (
    CORRECT_THRESHOLD,
    PairSelection,
    check_lengths,
    correct_mask,
    pick,
)
from megatron_dppo.algorithms.methods.configs import BPPOConfig

__all__ = [
    "BPPOConfig",
    "BPPOPlan",
    "check_no_completion_pruning",
    "denominator_terms",
    "next_wave",
    "plan",
    "prefix_length_histogram",
    "prefix_lengths",
    "prefix_token_mask",
    "select_pairs",
    "selection_weights",
    "step_metrics",
]


def select_pairs(rewards: torch.Tensor, lengths: torch.Tensor, threshold: float = CORRECT_THRESHOLD) -> PairSelection:
    """rewards [P, G], lengths [P, G] (generated tokens, EOS included) -> PairSelection with
    correct [P] = the shortest correct, wrong [P] = the shortest incorrect, -1 in both for groups
    that are not mixed. Truncated (overlong) completions are incorrect by their reward and are
    picked only when every incorrect one is longer."""
    correct = correct_mask(rewards, threshold)
    lengths = check_lengths(lengths, rewards.shape)
    c, w = pick(lengths, correct), pick(lengths, ~correct)
    mixed = (c >= 0) & (w >= 0)
    none = torch.full_like(c, -1)
    return PairSelection(correct=torch.where(mixed, c, none), wrong=torch.where(mixed, w, none))


def prefix_lengths(selection: PairSelection, lengths: torch.Tensor, cfg: BPPOConfig) -> torch.Tensor:
    """Trained prefix length P_i of every completion, [P, G] int64, 0 for the unselected.

    pair_min (default, our choice: the prefix both share in length, so the longer one's tail, the
    redundant suffix, is never reinforced or penalised): P_c = P_w = min(L_c, L_w).
    ratio: P_i = ceil(prefix_ratio * L_i). fixed: P_i = min(prefix_fixed, L_i).
    Then P_i = clamp(P_i, 1, L_i) and P_i <= ceil(max_ratio * L_i). docs/methods.md states the
    max_ratio cap for pair_min; it is applied after every mode here (a no-op at the default 1.0).
    """
    lengths = check_lengths(lengths, lengths.shape)
    is_c, is_w = selection.masks(lengths.shape[1])
    picked = is_c | is_w
    if cfg.prefix_mode == "pair_min":
        l_c = _gather(lengths, selection.correct)
        l_w = _gather(lengths, selection.wrong)
        p = torch.minimum(l_c, l_w)[:, None].expand_as(lengths)
    elif cfg.prefix_mode == "ratio":
        p = torch.ceil(lengths.double() * cfg.prefix_ratio).long()
    elif cfg.prefix_mode == "fixed":
        p = torch.full_like(lengths, cfg.prefix_fixed)
    else:
        raise ValueError(f"prefix_mode must be one of pair_min, ratio, fixed, got {cfg.prefix_mode!r}")
    p = torch.minimum(torch.maximum(p, torch.ones_like(p)), lengths)
    if cfg.max_ratio < 1:
        p = torch.minimum(p, torch.ceil(lengths.double() * cfg.max_ratio).long())
    return torch.where(picked, p, torch.zeros_like(p))


def _gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.gather(1, index.clamp(min=0)[:, None])[:, 0]


def selection_weights(
    selection: PairSelection, rewards: torch.Tensor, class_weight: str = "none", threshold: float = CORRECT_THRESHOLD
) -> torch.Tensor:
    """Per-sequence selection weight s_i, [P, G] float64: 0 unselected; 1 for c and w
    (class_weight=none; the paper most likely uses 1 [guess]); k for c and G - k for w with
    class_weight=count (our choice: the pair then carries its classes' total advantage mass)."""
    is_c, is_w = selection.masks(rewards.shape[1])
    if class_weight == "none":
        return (is_c | is_w).double()
    if class_weight != "count":
        raise ValueError(f"class_weight must be 'none' or 'count', got {class_weight!r}")
    k = correct_mask(rewards, threshold).sum(dim=1, keepdim=True).double()
    return is_c.double() * k + is_w.double() * (rewards.shape[1] - k)


def denominator_terms(
    prefix_len: torch.Tensor,
    seq_weight: torch.Tensor,
    loss_agg: str,
    *,
    prompt_weight: torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> float:
    """BPPO's own loss denominator for these groups (our choice; the paper's is unknown).

    A sum over groups, so the step's D is the sum of this value over its micro-batches and DP
    ranks: compute it ONCE per step from the whole step's groups (all-reduce it over DP) before
    the first micro-batch; it then does not depend on micro-batching or layout.
        token-mean:              D = sum_q w_q sum_i s_i P_i      (s = 1: sum over mixed q of P_c + P_w)
        seq-mean-token-mean:     D = sum_q w_q sum_i s_i          (s = 1: 2 x the mixed prompts)
        seq-mean-token-sum-norm: D = Lmax sum_q w_q sum_i s_i     (our extension: Dr.GRPO's constant)
    s_i is `selection_weights` (with class_weight=count the mean is then weighted by k and G - k:
    our choice). prompt_weight w_q [P] (DPPO's prompt pruning; None = 1) keeps the sum a
    Horvitz-Thompson estimate of the unpruned step's. Never the DPPO full-batch B*G or T_full:
    they make the gradient about G/2 times smaller. 0.0 means nothing to train in these groups.
    """
    w = seq_weight.double()
    if prompt_weight is not None:
        if prompt_weight.shape != seq_weight.shape[:1]:
            raise ValueError(
                f"prompt_weight must have shape {tuple(seq_weight.shape[:1])}, got {tuple(prompt_weight.shape)}"
            )
        w = w * prompt_weight.double()[:, None]
    if loss_agg == "token-mean":
        return float((w * prefix_len.double()).sum())
    if loss_agg == "seq-mean-token-mean":
        return float(w.sum())
    if loss_agg == "seq-mean-token-sum-norm":
        if not max_response_length or max_response_length < 1:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs max_response_length >= 1")
        return float(w.sum()) * max_response_length
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


@dataclass(frozen=True)
class BPPOPlan:
    selection: PairSelection
    prefix_len: torch.Tensor  # [P, G] int64: tokens t < prefix_len are trained; 0 = not trained
    seq_weight: torch.Tensor  # [P, G] float64: w_q * s_i (0 = not trained)
    denominator_terms: float  # these groups' share of D (sum it over DP ranks)


def plan(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    cfg: BPPOConfig,
    *,
    loss_agg: str,
    prompt_weight: torch.Tensor | None = None,
    max_response_length: int | None = None,
    threshold: float = CORRECT_THRESHOLD,
) -> BPPOPlan:
    """Everything BPPO decides for a step's groups, from rewards and lengths only (so it runs
    before the log-prob pass). rewards, lengths [P, G]; prompt_weight [P] or None."""
    selection = select_pairs(rewards, lengths, threshold)
    prefix = prefix_lengths(selection, lengths, cfg)
    s = selection_weights(selection, rewards, cfg.class_weight, threshold)
    d = denominator_terms(prefix, s, loss_agg, prompt_weight=prompt_weight, max_response_length=max_response_length)
    seq_weight = s if prompt_weight is None else s * prompt_weight.double()[:, None]
    return BPPOPlan(selection=selection, prefix_len=prefix, seq_weight=seq_weight, denominator_terms=d)


def prefix_token_mask(prefix_len: torch.Tensor, seq_index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """bool [T] over a flat run of completion tokens (losses.py's layout): token t, at `position[t]`
    (0-based, within its completion) of sequence `seq_index[t]`, is trained iff
    position < prefix_len[seq_index]. prefix_len [S] (a flattened BPPOPlan.prefix_len)."""
    return position < prefix_len[seq_index]


def check_no_completion_pruning(r_o: float, *, bppo_key: str = "algorithm.selection", r_o_key: str = "pruning.r_o"):
    """BPPO's selection replaces DPPO's completion pruning (our choice): r_o > 0 is a config error."""
    if r_o > 0:
        raise ValueError(
            f"config keys {bppo_key!r}=bppo and {r_o_key!r}={r_o!r} conflict: BPPO's pair selection replaces "
            f"completion pruning, set {r_o_key}=0"
        )


def next_wave(
    rewards_so_far: Sequence[float], wave_size: int, max_group_size: int, threshold: float = CORRECT_THRESHOLD
) -> int:
    """schedule=waves (our reading (a) of the paper's "adaptive completion scheduling", whose
    mechanism is unknown): how many more completions to draw for one prompt, 0 = stop.

    Draw `wave_size` (g0) at a time until the group is mixed (one correct and one incorrect) and
    has >= g0 samples, or holds max_group_size (G_max). Advantages then use the completions
    actually drawn (a group size per prompt). The trainer's rollout (train/step_rollout.StepRollout) calls it
    for every prompt after each wave's gather.
    """
    if wave_size < 1 or max_group_size < 1:
        raise ValueError(f"wave_size and max_group_size must be >= 1, got {wave_size}, {max_group_size}")
    n = len(rewards_so_far)
    correct = sum(1 for r in rewards_so_far if r >= threshold)
    mixed = 0 < correct < n
    if n >= max_group_size or (mixed and n >= wave_size):
        return 0
    wave = wave_size - n if mixed else wave_size  # mixed early (only after a partial wave): top up to g0
    return min(wave, max_group_size - n)


def prefix_length_histogram(prefix_len: torch.Tensor, edges: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128)) -> dict:
    """Counts of the trained prefix lengths by bucket [edge_i, edge_{i+1}) and the last one open,
    for logging (docs/methods.md 1.2: very short correct answers give P of a few tokens)."""
    p = prefix_len[prefix_len > 0]
    bounds = [*edges, math.inf]
    return {
        f"{lo}-{'' if hi == math.inf else hi - 1}": int(((p >= lo) & (p < hi)).sum())
        for lo, hi in zip(bounds, bounds[1:])
    }


def step_metrics(prefix_len: Sequence[torch.Tensor], advantages: Sequence[torch.Tensor]) -> dict:
    """What docs/methods.md section 1 asks to log per step, from each run of equal-size groups' plan:
    prefix_len [P, G] (BPPOPlan.prefix_len: > 0 = the pair) and the full-group advantages [P, G].
    bppo/prefix_len/<bucket>: the trained prefixes' lengths (`prefix_length_histogram`);
    bppo/pair_abs_adv: mean |A| of the pairs' completions; bppo/group_abs_adv: mean |A| over all
    completions of the groups that have a pair (what the pair's two advantages are drawn from);
    bppo/pairs: the number of pairs. Means are 0 when no group has a pair."""
    flat = torch.cat([p.flatten() for p in prefix_len]) if prefix_len else torch.zeros(0, dtype=torch.long)
    pair, group = [], []
    for p, a in zip(prefix_len, advantages):
        chosen = p > 0
        pair.append(a[chosen].abs().double())
        group.append(a[chosen.any(dim=1)].abs().double().flatten())
    pair_abs, group_abs = torch.cat(pair) if pair else torch.zeros(0), torch.cat(group) if group else torch.zeros(0)
    return {
        **{f"bppo/prefix_len/{k}": v for k, v in prefix_length_histogram(flat).items()},
        "bppo/pairs": int((flat > 0).sum()) // 2,
        "bppo/pair_abs_adv": float(pair_abs.mean()) if pair_abs.numel() else 0.0,
        "bppo/group_abs_adv": float(group_abs.mean()) if group_abs.numel() else 0.0,
    }
