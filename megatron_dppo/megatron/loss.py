"""The DPPO loss of one micro-batch on the last pipeline stage, and the step's metrics record.

The loss is sum_t coef_t * loss_t with coef_t = (t's sequence weight) / (the FULL mini-batch
denominator) [/ |o| for seq-mean-token-mean], fixed before the step (algorithms/losses.py), so
summing micro-batches, stages and ranks gives the same number whatever the split.
"""

from __future__ import annotations

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

# What each micro-batch reports, summed over its loss tokens (ratio_dev_max is a max instead).
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
    "aux_loss",
    "aux_div_sum",
    "aux_positions",
)


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
    aux_loss: float  # SSOPD: lambda * L_aux, the auxiliary term in the loss (0 without it)
    aux_divergence: float  # SSOPD: mean d_t over the distilled positions (NaN without any)

    @classmethod
    def from_sums(cls, sums: dict, ratio_dev_max: float) -> TrainReport:
        n = max(sums["tokens"], 1)
        return cls(
            loss=sums["loss"],
            tokens=sums["tokens"],
            clip_frac=sums["clip_frac_sum"] / n,
            kl=sums["kl_sum"] / n,
            ratio_dev_mean=sums["ratio_dev_sum"] / n,
            ratio_dev_max=ratio_dev_max,
            approx_kl=sums["approx_kl_sum"] / n,
            entropy=sums["entropy_sum"] / n,
            logprob_gap_vllm=sums["rollout_gap_sum"] / sums["rollout_gap_tokens"]
            if sums["rollout_gap_tokens"]
            else float("nan"),
            aux_loss=sums["aux_loss"],
            aux_divergence=sums["aux_div_sum"] / sums["aux_positions"] if sums["aux_positions"] else float("nan"),
        )

    def as_dict(self) -> dict:
        return asdict(self)


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

    # No old log-probs: the batch is trained right after it was generated, in one optimizer step,
    # so pi_old = pi_theta exactly and the ratio is 1 (with its gradient): the separate
    # old-log-prob pass would recompute the same numbers. With several mini-batches or epochs the
    # trainer attaches pi_old (the rollout policy's log-probs, taken before any update).
    lp, seq_index = logp.index_select(0, index), picked(batch.seq_index)  # the loss tokens' (one gather each)
    old_logp = picked(batch.old_logp) if batch.old_logp is not None else lp.detach()
    reweighting = reweighting or registry.recipe(algorithm).reweighting
    token_loss, stats = _token_loss(algorithm, reweighting, lp, old_logp, batch, picked, seq_index)
    seq_weight, seq_len = batch.seq_weight.to(dev), batch.seq_len.to(dev)
    coef = losses.token_coefficients(seq_index, seq_weight, seq_len, algorithm.loss_agg, denominator)
    loss = losses.aggregate(token_loss, coef)
    report = _report(loss, n_tokens, lp, old_logp, stats)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    report.update(aux_loss=zero, aux_div_sum=zero, aux_positions=zero)
    gap = (lp.detach() - picked(batch.rollout_logp)).abs() if batch.rollout_logp is not None else None
    report["rollout_gap_sum"] = gap.double().sum() if gap is not None else zero
    report["rollout_gap_tokens"] = n_tokens.double() if gap is not None else zero
    report["entropy_sum"] = entropy_sum(entropy, index)
    return loss, n_tokens, report


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
    report["ratio_dev_max"] = zero
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


def reduce_reports(reports: list[dict]) -> TrainReport:
    """Sum the last stages' micro-batch reports over DP (TP rank 0 only: TP ranks repeat them);
    the max |ratio - 1| is reduced with a max. Collective over the world."""
    dev = current_device()
    sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=dev)
    dev_max = torch.zeros(1, dtype=torch.float64, device=dev)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for r in reports:
            sums += torch.stack([r[k].to(dev) for k in SUMMED])
            dev_max = torch.maximum(dev_max, r["ratio_dev_max"].to(dev))
    dist.all_reduce(sums)
    dist.all_reduce(dev_max, op=dist.ReduceOp.MAX)
    return TrainReport.from_sums(dict(zip(SUMMED, sums.tolist())), float(dev_max))
