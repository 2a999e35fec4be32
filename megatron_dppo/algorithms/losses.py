"""Per-token policy losses and their aggregation with DPPO weights (docs/dppo.md sections 1 and 4).

Every tensor here is flat over the LOSS tokens of a batch (completion tokens only, any number
of sequences, any order): `seq_index[t]` says which sequence token t belongs to. That layout
serves a padded batch (flatten with the mask) and a packed THD micro-batch alike.

The aggregated loss is always sum_t coef_t * loss_t with coef_t fixed before any parameter
changes (the DPPO weight of t's sequence over a full-batch denominator). Summing that over
micro-batches, pipeline stages and data-parallel ranks gives the same number whatever the
split, and its expectation over the pruning masks is the full-batch loss.
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from megatron_dppo.algorithms.choices import KlEstimator, LossAgg, RatioType, RolloutCorrection

LOSS_AGGS = get_args(LossAgg)
RATIO_TYPES = get_args(RatioType)
KL_ESTIMATORS = get_args(KlEstimator)
ROLLOUT_CORRECTIONS = get_args(RolloutCorrection)
ROLLOUT_TRUNCATING = ("tis", "seq_tis", "tis_mask", "tis_seq_mask")  # read rollout_correction_cap
ROLLOUT_TOKEN_MASKING = ("mask", "tis_mask")  # read rollout_correction_low / _high (token ratios)
ROLLOUT_SEQ_MASKING = ("seq_mask", "tis_seq_mask")  # read rollout_correction_seq_low / _seq_high (geometric means)
ROLLOUT_MASKING = ROLLOUT_TOKEN_MASKING + ROLLOUT_SEQ_MASKING
# The rollout correction to use, from the bias + variance (MSE) table of docs/algorithm.md section 8
# (tools/rollout_correction_table.py, docs/rollout_correction_table.json: 8 seeds, completions of 4
# to 256 tokens, N = 2048 samples a step). One update behind (trainer.max_staleness >= 1) the product
# seq_tis has the lowest MSE up to 64 tokens (-34% to -4% against none) but loses to no correction at
# 256 (+14%: its cap binds), where token tis is the lowest (never worse than none at any length);
# for a bf16 or MoE rollout (numerics, not staleness) token tis. The start-up warnings, the
# disaggregated presets, the README and verify-unbiased read it.
RECOMMENDED_CORRECTION = {"staleness": "seq_tis", "staleness_long": "tis", "bf16": "tis"}
LONG_COMPLETION_TOKENS = 128  # completions longer than this (rollout.max_new_tokens) use "staleness_long"


def recommended_correction(staleness: int, completion_tokens: int | None = None) -> str:
    """The recommended algorithm.rollout_correction at this trainer.max_staleness for completions
    of up to `completion_tokens` tokens (rollout.max_new_tokens; None: short)."""
    if not staleness:
        return RECOMMENDED_CORRECTION["bf16"]
    long = completion_tokens is not None and completion_tokens > LONG_COMPLETION_TOKENS
    return RECOMMENDED_CORRECTION["staleness_long" if long else "staleness"]


def _segment_mean(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq_index, torch.ones_like(values)
    )
    return sums / counts.clamp(min=1)


def _segment_sum(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    kind: str,
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    seq_low: float = 0.999,
    seq_high: float = 1.001,
) -> tuple[torch.Tensor, dict]:
    """The rollout correction's weight of each loss token (docs/algorithm.md section 8), from
    rho_t = pi_old(o_t) / pi_rollout(o_t): -> (weight [T] float64, no gradient; stats with the bool
    tensors "truncated" [T] (the weight was cut to cap) and "masked" [T] (the weight is 0), and
    "masked_seqs", the number of sequences all of whose loss tokens are masked).

    tis           min(rho_t, cap)                            token-level truncated IS
    seq_tis       min(prod_t rho_t, cap), on every token     sequence level, the PRODUCT (verl's "sequence")
    mask          1[low <= rho_t <= high]                    token rejection (verl's token RS)
    seq_mask      1[seq_low <= exp(mean_t log rho_t) <= seq_high]   sequence rejection, geometric mean (verl)
    tis_mask      min(rho_t, cap) * the token mask           (verl token IS + token RS; OpenRLHF's icepop)
    tis_seq_mask  min(rho_t, cap) * the sequence mask        (NeMo-RL's / OpenRLHF's seq-mask-tis)

    The geometric mean has bounds of its own: a mean of many per-token log-ratios barely moves
    (at a bf16 gap of rho_t in [0.98, 1.03] it stays within ~1e-3 of 1), so the token mask's
    [0.5, 2] could never bind on it; verl's geometric rejection defaults to [1/1.001, 1.001]
    (its docs: "typical threshold 1.0002 - 1.001"), and the defaults here follow it.

    The weight multiplies the token's policy-gradient loss, not its KL term (corrected_aggregate);
    what it divides by is unchanged (a masked token stays in the aggregation's denominator: section 8
    says why)."""
    if kind not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction must be one of {ROLLOUT_CORRECTIONS}, got {kind!r}")
    with torch.no_grad():
        log_rho = (old_logp.detach() - rollout_logp.detach()).double()
        weight = torch.ones_like(log_rho)
        truncated = torch.zeros_like(log_rho, dtype=torch.bool)
        keep = torch.ones_like(log_rho, dtype=torch.bool)
        if kind in ("tis", "tis_mask", "tis_seq_mask"):
            rho = log_rho.exp()
            weight, truncated = rho.clamp(max=cap), rho > cap
        elif kind == "seq_tis":
            seq_rho = _segment_sum(log_rho, seq_index, num_seqs).exp()[seq_index]
            weight, truncated = seq_rho.clamp(max=cap), seq_rho > cap
        if kind in ("mask", "tis_mask"):
            rho = log_rho.exp()
            keep = (rho >= low) & (rho <= high)
        elif kind in ("seq_mask", "tis_seq_mask"):
            geo = _segment_mean(log_rho, seq_index, num_seqs).exp()[seq_index]
            keep = (geo >= seq_low) & (geo <= seq_high)
        weight = torch.where(keep, weight, torch.zeros_like(weight))
        tokens = _segment_sum(torch.ones_like(log_rho), seq_index, num_seqs)
        masked = _segment_sum((~keep).double(), seq_index, num_seqs)
        masked_seqs = ((tokens > 0) & (masked == tokens)).double().sum()
    return weight, {"truncated": truncated, "masked": ~keep, "masked_seqs": masked_seqs}


def idle_mask_note(kind: str, bounds: dict, ranges: dict) -> str | None:
    """The line for the log when the step's measured ratios could not reach the mask's bounds:
    rollout_correction `kind`, bounds {low, high, seq_low, seq_high}, ranges {"token": (min, max) of
    rho_t, "seq": (min, max) of the geometric means} (NaN where nothing was measured). A mask whose
    bounds lie outside every ratio the step had masked nothing and, at this gap, acts as no mask;
    None for a mask that could bind, for the kinds without a mask and when nothing was measured."""
    checks = []
    if kind in ROLLOUT_TOKEN_MASKING:
        checks.append(("token ratios", "rollout_correction_low/_high", ranges["token"], bounds["low"], bounds["high"]))
    if kind in ROLLOUT_SEQ_MASKING:
        checks.append(
            (
                "geometric-mean ratios",
                "rollout_correction_seq_low/_seq_high",
                ranges["seq"],
                bounds["seq_low"],
                bounds["seq_high"],
            )
        )
    for what, keys, (lo, hi), low, high in checks:
        if not (lo == lo and hi == hi):  # NaN: nothing measured
            continue
        if low <= lo and hi <= high:
            return (
                f"note: algorithm.rollout_correction={kind} masked nothing: the step's {what} ranged "
                f"[{lo:.6g}, {hi:.6g}], inside algorithm.{keys} [{low:g}, {high:g}]; at this gap the mask acts as "
                "no mask (docs/algorithm.md section 8)"
            )
    return None


def rollout_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, seq_index: torch.Tensor, num_seqs: int):
    """How far the rollout policy mu is from pi_old on the sampled loss tokens, as sums for the
    step's metrics (rho_t = pi_old / mu; every expectation is over mu's samples):
    rollout_ratio_sum/max/min (rho_t), rollout_kl_k1_sum (log mu - log pi_old: KL(mu || pi_old),
    unbiased), rollout_kl_k3_sum (rho - 1 - log rho: the same KL, unbiased and >= 0),
    rollout_chi2_sum (rho^2 - 1: chi^2(pi_old || mu), the token IS weights' variance),
    rollout_chi2_seq_sum over the sequences that have loss tokens ((prod_t rho_t)^2 - 1) and
    rollout_seqs, their count; rollout_geo_max/min, the largest and smallest geometric-mean ratio
    exp(mean_t log rho_t) of those sequences (what the sequence masks compare with their bounds).
    float64 scalars; no host sync (no boolean indexing)."""
    with torch.no_grad():
        log_rho = (old_logp.detach() - rollout_logp.detach()).double()
        rho = log_rho.exp()
        zero = torch.zeros((), dtype=torch.float64, device=log_rho.device)
        seq_log_rho = _segment_sum(log_rho, seq_index, num_seqs)
        present = _segment_sum(torch.ones_like(log_rho), seq_index, num_seqs) > 0
        seq_chi2 = torch.where(present, (2 * seq_log_rho).exp() - 1, torch.zeros_like(seq_log_rho))
        geo = _segment_mean(log_rho, seq_index, num_seqs).exp()
        return {
            "rollout_ratio_sum": rho.sum(),
            "rollout_ratio_max": rho.max() if rho.numel() else zero,
            "rollout_ratio_min": rho.min() if rho.numel() else zero + math.inf,
            "rollout_kl_k1_sum": (-log_rho).sum(),
            "rollout_kl_k3_sum": (rho - 1 - log_rho).sum(),
            "rollout_chi2_sum": (rho.square() - 1).sum(),
            "rollout_chi2_seq_sum": seq_chi2.sum(),
            "rollout_seqs": present.double().sum(),
            "rollout_geo_max": torch.where(present, geo, zero - math.inf).max() if geo.numel() else zero,
            "rollout_geo_min": torch.where(present, geo, zero + math.inf).min() if geo.numel() else zero + math.inf,
        }


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate from samples of pi_theta.
    k1 = log(pi/pi_ref) (unbiased, high variance); k3 = r - log r - 1 with r = pi_ref/pi
    (unbiased, non-negative, lower variance: Schulman's estimator, GRPO's choice)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - log_ratio - 1.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_type: str = "token",
    seq_index: torch.Tensor | None = None,
    num_seqs: int | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
):
    """Per-token clipped surrogate loss (+ beta * KL): returns (loss [T], stats dict); with a KL
    term stats["kl_term"] is beta * KL as added to the loss, gradient and all (corrected_aggregate).

    ratio_type "token": rho_t = pi/pi_old per token (GRPO; DAPO = clip_high 0.28).
    ratio_type "sequence": GSPO, rho_s = exp(mean_t log rho_t) per sequence, one clip per
    sequence; each of the sequence's tokens carries the sequence's loss.
    """
    if ratio_type not in RATIO_TYPES:
        raise ValueError(f"ratio_type must be one of {RATIO_TYPES}, got {ratio_type!r}")
    if not (logp.shape == old_logp.shape == advantages.shape) or logp.dim() != 1:
        raise ValueError(
            f"logp, old_logp and advantages must be equal 1-D shapes, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(advantages.shape)}"
        )
    log_ratio = logp - old_logp
    if ratio_type == "sequence":
        if seq_index is None or num_seqs is None:
            raise ValueError("ratio_type='sequence' (GSPO) needs seq_index and num_seqs")
        seq_log_ratio = _segment_mean(log_ratio, seq_index, num_seqs)
        log_ratio = seq_log_ratio[seq_index]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -surrogate
    with torch.no_grad():
        clip_frac = ((ratio * advantages) > (clipped * advantages)).float()
        stats = {"clip_frac": clip_frac, "ratio": ratio.detach()}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        kl_term = kl_coef * kl
        loss = loss + kl_term
        stats["kl"] = kl.detach()
        stats["kl_term"] = kl_term  # with its gradient: the rollout correction leaves it unweighted
    return loss, stats


def token_coefficients(
    seq_index: torch.Tensor, seq_weight: torch.Tensor, seq_length: torch.Tensor, loss_agg: str, denominator: float
) -> torch.Tensor:
    """coef [T] float64 with loss = sum_t coef_t * loss_t (cast it to the loss dtype at use).

    seq_weight [S]: the DPPO weight w_q * w_o of each sequence (1 without pruning).
    seq_length [S]: completion tokens of each sequence (|o|).
    denominator: the FULL-batch one from `full_batch_denominator`, never what survived.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator!r}")
    per_seq = seq_weight.double() / float(denominator)
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / seq_length.double().clamp(min=1)
    return per_seq[seq_index]


def aggregate(token_loss: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The weighted-sum reduction every layout shares: sum_t coef_t * loss_t."""
    return (token_loss * coef.to(token_loss.dtype)).sum()


def corrected_aggregate(
    token_loss: torch.Tensor, kl_term: torch.Tensor | None, coef: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The aggregate under the rollout correction: sum_t coef_t * (w_t * pg_t + kl_t), where
    token_loss = pg_t + kl_t (kl_term: kl_coef * the KL estimate, None without a KL term) and w_t
    the correction's weight (rollout_correction). The weight corrects the policy-gradient term's
    sampling distribution only; the KL penalty towards the reference keeps its plain coefficient,
    as in verl's objective (its rollout IS weights multiply the PG loss, not the KL loss), so a
    verl recipe with kl_coef > 0 trains the same objective here."""
    pg = token_loss if kl_term is None else token_loss - kl_term
    loss = aggregate(pg, coef * weight)
    return loss if kl_term is None else loss + aggregate(kl_term, coef)


def full_batch_denominator(
    loss_agg: str,
    *,
    num_prompts: int,
    group_size: int,
    completion_lengths: torch.Tensor | None = None,
    prompt_weight: torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> float:
    """The denominator the unpruned batch of num_prompts x group_size would have had.
    num_prompts may be fractional: with refill (DAPO) it is the trained groups' total weight.

    seq-mean-token-mean:     B * G                                (exact)
    seq-mean-token-sum-norm: B * G * max_response_length         (exact, Dr.GRPO's constant)
    token-mean:              total completion tokens of the full batch. completion_lengths
        [P_rolled, G] are the lengths of every GENERATED completion (before completion pruning,
        so that part is exact); prompts skipped before rollout are estimated Horvitz-Thompson
        style by weighting each rolled-out prompt's tokens with its prompt weight w_q
        (consistent, not exact; exact when no prompt was skipped).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if not num_prompts > 0 or group_size < 1:
        raise ValueError(f"num_prompts must be > 0 and group_size >= 1, got {num_prompts}, {group_size}")
    if loss_agg == "seq-mean-token-mean":
        return float(num_prompts * group_size)
    if loss_agg == "seq-mean-token-sum-norm":
        if not max_response_length or max_response_length < 1:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs max_response_length >= 1")
        return float(num_prompts * group_size * max_response_length)
    if completion_lengths is None or completion_lengths.dim() != 2:
        raise ValueError("loss_agg 'token-mean' needs completion_lengths [num_rolled_prompts, G]")
    per_prompt = completion_lengths.double().sum(dim=1)
    if prompt_weight is not None:
        if prompt_weight.shape != per_prompt.shape:
            raise ValueError(
                f"prompt_weight must have shape {tuple(per_prompt.shape)}, got {tuple(prompt_weight.shape)}"
            )
        per_prompt = per_prompt * prompt_weight.double()
    total = float(per_prompt.sum())
    if total <= 0:
        raise ValueError("token-mean denominator is 0: no completion tokens were generated")
    return total


def kept_denominator(loss_agg: str, seq_weight: torch.Tensor, lengths: torch.Tensor, max_len: int) -> float:
    """CPPO's normaliser: what was kept (sequences with weight > 0), not the full batch."""
    kept = seq_weight.flatten() > 0
    n = float(kept.sum())
    if loss_agg == "token-mean":
        n = float(lengths.flatten()[kept].sum())
    elif loss_agg == "seq-mean-token-sum-norm":
        n *= max_len
    if n <= 0:
        raise ValueError("kept denominator is 0: nothing was kept")
    return n


def refill_denominator(
    loss_agg: str, group_weight: torch.Tensor, lengths: torch.Tensor, group_size: int, max_len: int
) -> float:
    """The DAPO + DPPO rule (docs/algorithm.md): the aggregation's normaliser of the unpruned
    batch, estimated with the trained groups' weights W_g: G * sum W, G * Lmax * sum W, or
    sum_g W_g * tokens_g (lengths [groups, G], all G completions of each trained group)."""
    if loss_agg == "token-mean":
        return full_batch_denominator(
            loss_agg, num_prompts=1, group_size=group_size, completion_lengths=lengths, prompt_weight=group_weight
        )
    per_group = full_batch_denominator(loss_agg, num_prompts=1, group_size=group_size, max_response_length=max_len)
    return per_group * float(group_weight.double().sum())
