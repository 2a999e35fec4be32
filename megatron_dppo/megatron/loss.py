"""The DPPO loss of one micro-batch on the last pipeline stage, and the step's metrics record.

The loss is sum_t coef_t * loss_t with coef_t = (t's sequence weight) / (the FULL mini-batch
denominator) [/ |o| for seq-mean-token-mean], fixed before the step (algorithms/losses.py), so
summing micro-batches, stages and ranks gives the same number whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.methods import registry
from megatron_dppo.algorithms.methods.reco import rules as reco
from megatron_dppo.algorithms.methods.ssopd import rules as ssopd
from megatron_dppo.megatron.logprobs import entropy_sum, token_logprobs, token_logprobs_detached_entropy
from megatron_dppo.megatron.model import current_device

# What each micro-batch reports, summed over its loss tokens (MAXED are maxima instead).
SUMMED = (
    "loss",
    "tokens",
    "clip_frac_sum",
    "kl_sum",
    "ratio_dev_sum",
    "approx_kl_sum",
    "entropy_sum",
    "rollout_gap_sum",
    "rollout_gap_tokens",
    "rollout_ratio_sum",  # the rollout mismatch (losses.rollout_mismatch), over the same tokens
    "rollout_kl_k1_sum",
    "rollout_kl_k3_sum",
    "rollout_chi2_sum",
    "rollout_chi2_seq_sum",
    "rollout_seqs",
    "rollout_truncated",  # the rollout correction's (losses.rollout_correction): tokens, and
    "rollout_masked",  # sequences with every loss token masked
    "rollout_masked_seqs",
    "aux_loss",
    "aux_div_sum",
    "aux_positions",
)
# The minimum ratio is reduced as the maximum of its negative.
MAXED = ("ratio_dev_max", "rollout_ratio_max", "rollout_ratio_neg_min", "rollout_geo_max", "rollout_geo_neg_min")


@dataclass
class TrainReport:
    """One forward_backward's metrics, reduced over micro-batches and data-parallel ranks."""

    loss: float
    tokens: float
    clip_frac: float
    kl: float
    ratio_dev_mean: float
    ratio_dev_max: float
    approx_kl: float
    entropy: float  # the policy's mean next-token entropy over the trained tokens
    # mean |log pi_theta - log pi_vllm| of the sampled tokens (NaN without the engine's log-probs):
    # at the first update of a step pi_theta is the rollout policy, so this is the engines' mismatch
    logprob_gap_vllm: float
    # rho_t = pi_old / pi_rollout of the sampled tokens (NaN without the engine's log-probs): its
    # mean / max / min, KL(rollout || pi_old) by the k1 and k3 estimators, chi^2(pi_old || rollout)
    # of the token ratios and of the sequences' products (docs/algorithm.md section 8)
    rollout_ratio_mean: float
    rollout_ratio_max: float
    rollout_ratio_min: float
    rollout_kl_k1: float
    rollout_kl_k3: float
    rollout_chi2_token: float
    rollout_chi2_seq: float
    # the sequences' geometric-mean rho exp(mean_t log rho_t): largest and smallest (the sequence masks' quantity)
    rollout_seq_geo_max: float
    rollout_seq_geo_min: float
    aux_loss: float  # SSOPD: lambda * L_aux, the auxiliary term in the loss (0 without it)
    aux_divergence: float  # SSOPD: mean d_t over the distilled positions (NaN without any)
    # Under algorithm.rollout_correction only (None otherwise: not reported): the share of loss
    # tokens whose weight was cut to the cap, of those masked, of sequences masked whole
    rollout_truncated_frac: float | None = None
    rollout_masked_token_frac: float | None = None
    rollout_masked_seq_frac: float | None = None

    @classmethod
    def from_sums(cls, sums: dict, maxima: dict, corrected: bool = False) -> TrainReport:
        n = max(sums["tokens"], 1)
        rollout_n, seqs = sums["rollout_gap_tokens"], sums["rollout_seqs"]

        def per_token(key):
            return sums[key] / rollout_n if rollout_n else float("nan")

        correction = {}
        if corrected:
            correction = dict(
                rollout_truncated_frac=per_token("rollout_truncated"),
                rollout_masked_token_frac=per_token("rollout_masked"),
                rollout_masked_seq_frac=sums["rollout_masked_seqs"] / seqs if seqs else float("nan"),
            )
        return cls(
            **correction,
            rollout_ratio_mean=per_token("rollout_ratio_sum"),
            rollout_ratio_max=maxima["rollout_ratio_max"] if rollout_n else float("nan"),
            rollout_ratio_min=-maxima["rollout_ratio_neg_min"] if rollout_n else float("nan"),
            rollout_kl_k1=per_token("rollout_kl_k1_sum"),
            rollout_kl_k3=per_token("rollout_kl_k3_sum"),
            rollout_chi2_token=per_token("rollout_chi2_sum"),
            rollout_chi2_seq=sums["rollout_chi2_seq_sum"] / seqs if seqs else float("nan"),
            rollout_seq_geo_max=maxima["rollout_geo_max"] if seqs else float("nan"),
            rollout_seq_geo_min=-maxima["rollout_geo_neg_min"] if seqs else float("nan"),
            loss=sums["loss"],
            tokens=sums["tokens"],
            clip_frac=sums["clip_frac_sum"] / n,
            kl=sums["kl_sum"] / n,
            ratio_dev_mean=sums["ratio_dev_sum"] / n,
            ratio_dev_max=maxima["ratio_dev_max"],
            approx_kl=sums["approx_kl_sum"] / n,
            entropy=sums["entropy_sum"] / n,
            logprob_gap_vllm=sums["rollout_gap_sum"] / sums["rollout_gap_tokens"]
            if sums["rollout_gap_tokens"]
            else float("nan"),
            aux_loss=sums["aux_loss"],
            aux_divergence=sums["aux_div_sum"] / sums["aux_positions"] if sums["aux_positions"] else float("nan"),
        )

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def micro_batch_loss(
    batch, logits, *, algorithm, vocab_size: int, temperature: float, mode: str, denominator, reweighting=None
):
    """logits [b, s, V/tp] -> (loss, number of loss tokens, report dict of SUMMED + ratio_dev_max).
    mode "logprob" returns the per-position log-probs instead (no loss); "logprob+gini" also the
    Gini impurity 1 - sum_v pi(v)^2 of each position's next-token distribution (ReCo's token
    scale, vocab-parallel). Works for a packed row (b = 1) and for the padded baseline (b = rows).
    reweighting: the config's reweighting option (algorithms/methods/registry.recipe), whose
    token_loss may replace the clipped surrogate; looked up from `algorithm` when not given."""
    dev = logits.device
    if batch.aux is not None:
        return _aux_loss(batch, logits, algorithm.ssopd, vocab_size)
    labels = batch.labels.to(dev)
    host_index = loss_positions(batch.loss_mask)
    index = host_index.to(dev)
    n_tokens = torch.tensor(host_index.numel(), dtype=torch.int, device=dev)
    if mode.startswith("logprob"):
        logp = token_logprobs(logits, labels, vocab_size=vocab_size, temperature=temperature).flatten()
        return logp.sum() * 0.0, n_tokens, _logprob_outputs(batch, logits, logp, mode, vocab_size, temperature)
    logp, entropy = token_logprobs_detached_entropy(logits, labels, vocab_size=vocab_size, temperature=temperature)
    logp = logp.flatten()

    def picked(t):
        """The loss tokens' entries of a per-position tensor: a host tensor is gathered on the
        host and only its loss tokens are copied over (no stream sync); a device one there."""
        if t.device == dev:
            return t.flatten().index_select(0, index)
        return t.flatten().index_select(0, host_index).to(dev, non_blocking=True)

    # pi_old is the TRAINER's weights at the start of the step, before any update. Colocated
    # (trainer.max_staleness=0) they are the weights vLLM sampled with (up to the engines' numerics:
    # the rollout correction's rho); with dedicated rollout ranks at max_staleness=1 they are one
    # update newer than the sampler's. No old log-probs: the batch is trained in one optimizer step,
    # so pi_old = pi_theta exactly and the ratio is 1 (with its gradient): the separate old-log-prob
    # pass would recompute the same numbers. With several mini-batches or epochs the trainer
    # attaches pi_old's log-probs, taken before any update.
    lp, seq_index = logp.index_select(0, index), picked(batch.seq_index)  # the loss tokens' (one gather each)
    old_logp = picked(batch.old_logp) if batch.old_logp is not None else lp.detach()
    reweighting = reweighting or registry.recipe(algorithm).reweighting
    token_loss, stats = _token_loss(algorithm, reweighting, lp, old_logp, batch, picked, seq_index)
    seq_weight, seq_len = batch.seq_weight.to(dev), batch.seq_len.to(dev)
    coef = losses.token_coefficients(seq_index, seq_weight, seq_len, algorithm.loss_agg, denominator)
    rollout_logp = picked(batch.rollout_logp) if batch.rollout_logp is not None else None
    correction = None
    if host_index.numel():  # a micro-batch without loss tokens (an idle DP slot's filler) has nothing to correct
        correction = _rollout_correction(algorithm, old_logp, rollout_logp, seq_index, batch.num_seqs)
    if correction is None:
        loss = losses.aggregate(token_loss, coef)
    else:  # rho's weight on each token's policy-gradient term, not its KL term; the denominator stays
        loss = losses.corrected_aggregate(token_loss, stats.get("kl_term"), coef, correction[0])
    report = _report(loss, n_tokens, lp, old_logp, stats)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    report.update(aux_loss=zero, aux_div_sum=zero, aux_positions=zero)
    report.update(_rollout_report(lp, old_logp, rollout_logp, seq_index, batch.num_seqs, correction, n_tokens))
    report["entropy_sum"] = entropy_sum(entropy, index)
    return loss, n_tokens, report


def _rollout_correction(algorithm, old_logp, rollout_logp, seq_index, num_seqs):
    """(weight [T], stats) of algorithm.rollout_correction (losses.rollout_correction); None when off."""
    kind = algorithm.rollout_correction
    if kind == "none":
        return None
    if rollout_logp is None:
        raise ValueError(
            f"algorithm.rollout_correction={kind} needs the rollout engine's log-probs of every trained "
            "token, and this micro-batch carries none (Sample.rollout_logp)"
        )
    return losses.rollout_correction(
        old_logp,
        rollout_logp,
        seq_index,
        num_seqs,
        kind,
        cap=algorithm.rollout_correction_cap,
        low=algorithm.rollout_correction_low,
        high=algorithm.rollout_correction_high,
        seq_low=algorithm.rollout_correction_seq_low,
        seq_high=algorithm.rollout_correction_seq_high,
    )


def _rollout_report(lp, old_logp, rollout_logp, seq_index, num_seqs, correction, n_tokens) -> dict:
    """The micro-batch's rollout-mismatch sums (zeros, and no maximum, without the engine's log-probs)."""
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    out = {k: zero for k in SUMMED if k.startswith("rollout_")}
    out.update(rollout_ratio_max=zero, rollout_ratio_neg_min=zero - math.inf)
    out.update(rollout_geo_max=zero - math.inf, rollout_geo_neg_min=zero - math.inf)
    if rollout_logp is None:
        return out
    out["rollout_gap_sum"] = (lp.detach() - rollout_logp).abs().double().sum()
    out["rollout_gap_tokens"] = n_tokens.double()
    mismatch = losses.rollout_mismatch(old_logp, rollout_logp, seq_index, num_seqs)
    out["rollout_ratio_neg_min"] = -mismatch.pop("rollout_ratio_min")
    out["rollout_geo_neg_min"] = -mismatch.pop("rollout_geo_min")
    out.update(mismatch)
    if correction is not None:
        flags = correction[1]
        out.update(
            rollout_truncated=flags["truncated"].double().sum(),
            rollout_masked=flags["masked"].double().sum(),
            rollout_masked_seqs=flags["masked_seqs"],
        )
    return out


def loss_positions(loss_mask) -> torch.Tensor:
    """The flat positions where loss_mask > 0, found on the host (the batch's masks are host
    tensors): the loss gathers them with index_select, where a boolean mask would make the
    device report its count back to the host once per gather."""
    return torch.nonzero(loss_mask.detach().cpu().flatten() > 0).squeeze(1)


def _logprob_outputs(batch, logits, logp, mode: str, vocab_size: int, temperature: float) -> dict:
    """The log-prob pass's outputs: per-position log-probs, and with "logprob+gini" ReCo's impurity."""
    out = {"logp": logp.detach().view(batch.labels.shape)}
    if mode == "logprob+gini":
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rows = logits.detach().reshape(-1, logits.size(-1))
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        gini = reco.gini_impurity(rows, vocab_size=vocab_size, temperature=temperature, group=group)
        out["gini"] = gini.view(batch.labels.shape)
    return out


def _token_loss(a, reweighting, logp, old_logp, batch, picked, seq_index):
    """The per-token policy loss of the loss tokens: the reweighting's own (ReCo's surrogate), or
    the clipped surrogate (GRPO / DAPO / GSPO settings) with its KL term."""
    advantages = picked(batch.advantages)
    own = reweighting.token_loss(a, logp, old_logp, advantages, batch, picked)
    if own is not None:
        return own
    return losses.policy_loss(
        logp,
        old_logp,
        advantages,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        ratio_type=a.ratio_type,
        seq_index=seq_index,
        num_seqs=batch.num_seqs,
        ref_logp=picked(batch.ref_logp) if a.kl_coef else None,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
    )


def _aux_loss(batch, logits, cfg, vocab_size: int):
    """SSOPD's term for a micro-batch of teacher/student pairs (megatron_dppo/algorithms/methods/ssopd/distill.py):
    sum over distilled positions of coef * d_t(teacher, student), the teacher side detached, the
    divergence vocab-parallel over TP and chunked over positions (ssopd.divergence)."""
    aux, dev = batch.aux, logits.device
    rows = logits.reshape(-1, logits.size(-1))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    d = ssopd.divergence(
        rows[aux.teacher_rows.to(dev)].detach(),
        rows[aux.student_rows.to(dev)],
        cfg.div,
        targets=aux.targets.to(dev),
        tau=cfg.tau,
        beta=cfg.jsd_beta,
        topk=cfg.topk,
        vocab_size=vocab_size,
        group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
    )
    loss = (d * aux.coef.to(dev).to(d.dtype)).sum()
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    report = {k: zero for k in SUMMED}
    report.update(
        aux_loss=loss.detach().double(), aux_div_sum=d.detach().double().sum(), aux_positions=zero + d.numel()
    )
    report.update({k: zero for k in MAXED}, rollout_ratio_neg_min=zero - math.inf)
    report.update(rollout_geo_max=zero - math.inf, rollout_geo_neg_min=zero - math.inf)
    return loss, torch.zeros((), dtype=torch.int, device=dev), report


@torch.no_grad()
def _report(loss, n_tokens, logp, old_logp, stats) -> dict:
    zero = torch.zeros((), dtype=torch.float64, device=loss.device)
    log_ratio = (logp - old_logp).double()
    ratio_dev = (stats["ratio"].double() - 1).abs()
    return {
        "loss": loss.detach().double(),
        "tokens": n_tokens.double(),
        "clip_frac_sum": stats["clip_frac"].sum().double(),
        "kl_sum": stats["kl"].sum().double() if "kl" in stats else zero,
        "ratio_dev_sum": ratio_dev.sum(),
        "ratio_dev_max": ratio_dev.max() if ratio_dev.numel() else zero,
        # k3 estimate of KL(pi_old || pi) from the tokens sampled by pi_old
        "approx_kl_sum": (log_ratio.exp() - 1 - log_ratio).sum(),
    }


def reduce_reports(reports: list[dict], corrected: bool = False) -> TrainReport:
    """Sum the last stages' micro-batch reports over DP (TP rank 0 only: TP ranks repeat them);
    MAXED are reduced with a max. Collective over the world. corrected: algorithm.rollout_correction
    is on, so its shares are reported."""
    dev = current_device()
    sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=dev)
    maxima = torch.full((len(MAXED),), -math.inf, dtype=torch.float64, device=dev)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for r in reports:
            sums += torch.stack([r[k].to(dev) for k in SUMMED])
            maxima = torch.maximum(maxima, torch.stack([r[k].to(dev) for k in MAXED]))
    dist.all_reduce(sums)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    maxima = dict(zip(MAXED, maxima.tolist()))
    maxima["ratio_dev_max"] = max(maxima["ratio_dev_max"], 0.0)  # 0 when nothing was trained, as before
    return TrainReport.from_sums(dict(zip(SUMMED, sums.tolist())), maxima, corrected)
