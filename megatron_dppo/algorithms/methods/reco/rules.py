"""ReCo: reweighting GRPO against distributional concentration (docs/methods.md section 2).

The abstract gives two ideas [paper]: each response's contribution is divided by its expected
occurrence in the group, and the importance ratio is replaced by a variance-based ratio that is
larger where alternatives remain plausible. Every formula below is our reconstruction [guess].

1. Response weight u_i (`response_weights`), fixed before any update, from the rollout:
   expected: u_i = 1 / max(1, G pi_b(o_i|x)) = exp(-max(0, log G + sum_t log pi_b(a_t|s_t))), with
             pi_b the distribution actually SAMPLED (temperature, top-p/top-k applied): the engine
             must return processed log-probs (vLLM `logprobs_mode="processed_logprobs"`; see
             `check_logprobs_mode` and `check_processed_logprobs`).
   count:    u_i = 1 / #{j : o_j == o_i} over exact token duplicates (our choice, an ablation).
   renorm:   u_i <- u_i * G / sum_j u_j (off by default).
   The sequence weight becomes w_q * w_o * u_i.
2. Token scale c_t = sg[g_t / mean_step(g)] (`token_scale`), g from pi_old, so fixed before the update:
   gini:      g_t = 1 - sum_v pi_old(v|s_t)^2 (`gini_impurity`: one vocab-parallel reduction per
              token in the pi_old pass, chunked over positions, like the entropy kernel);
   bernoulli: g_t = pi_old(a_t)(1 - pi_old(a_t)) (`bernoulli_impurity`: no vocab pass);
   var_ratio: c_t = sg[pi_theta(a)(1 - pi_theta(a)) / (pi_old(a)(1 - pi_old(a)))] used in place of
              rho inside the usual clip (`var_ratio_scale`, `surrogate(clip_scale=True)`).
3. Per-token loss (`surrogate`): l_t = -A_t c_t log pi_theta(a_t), zeroed where PPO's clip would
   zero the token (trust region, our choice); the KL term is unchanged (losses.kl_penalty, added
   by the caller).

DPPO composition: u and g are fixed before any update and do not depend on the pruning masks;
c's normaliser, the step mean of g, is estimated from the trained tokens (`step_mean_terms`), a
ratio: with token_scale gini or bernoulli, DPPO is consistent (not exact) for the ReCo
full-batch loss whenever pruning draws; with none or var_ratio it is as exact as for GRPO.
Biased vs GRPO by design.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_dppo.algorithms._checks import check_group_tensor
from megatron_dppo.algorithms.methods import _vocab
from megatron_dppo.algorithms.methods.configs import ReCoConfig

__all__ = [
    "ReCoConfig",
    "bernoulli_impurity",
    "check_logprobs_mode",
    "check_processed_logprobs",
    "duplicate_count_weights",
    "expected_occurrence_weights",
    "frequent_fraction",
    "gini_impurity",
    "processed_logprobs",
    "renormalise",
    "response_weights",
    "step_mean_terms",
    "surrogate",
    "token_scale",
    "var_ratio_scale",
]

MIN_MEAN_IMPURITY = 1e-8  # docs/methods.md 2.2's guard on mean(g)


def expected_occurrence_weights(sampling_logprob_sums: torch.Tensor) -> torch.Tensor:
    """sampling_logprob_sums [P, G]: sum over each completion's tokens of the SAMPLED log-prob
    log pi_b(a_t|s_t) (processed: temperature/top-p applied) -> u [P, G] in (0, 1]:
    u = exp(-max(0, log G + log pi_b(o|x))), computed in log space. u = 1 whenever G pi_b < 1
    (every long chain of thought): rare responses are never up-weighted beyond one sample."""
    check_group_tensor("sampling_logprob_sums", sampling_logprob_sums)
    if (sampling_logprob_sums > 1e-6).any():
        raise ValueError("sampling_logprob_sums must be log-probabilities (<= 0)")
    log_expected = math.log(sampling_logprob_sums.shape[1]) + sampling_logprob_sums.double()
    return torch.exp(-log_expected.clamp(min=0)).float()


def duplicate_count_weights(completion_ids: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """completion_ids [P][G] token-id lists -> u [P, G] = 1 / (number of completions of the same
    group with exactly the same tokens, itself included)."""
    rows = []
    for q, group in enumerate(completion_ids):
        if len(group) != len(completion_ids[0]):
            raise ValueError(
                f"completion_ids[{q}] has {len(group)} completions, completion_ids[0] has {len(completion_ids[0])}"
            )
        keys = [tuple(ids) for ids in group]
        counts = {k: keys.count(k) for k in set(keys)}
        rows.append([1.0 / counts[k] for k in keys])
    return torch.tensor(rows, dtype=torch.float32)


def renormalise(u: torch.Tensor) -> torch.Tensor:
    """u [P, G] -> u * G / sum_j u_j per group (each group's weights then average 1)."""
    return u * (u.shape[1] / u.sum(dim=1, keepdim=True))


def response_weights(
    cfg: ReCoConfig,
    *,
    sampling_logprob_sums: torch.Tensor | None = None,
    completion_ids: Sequence[Sequence[Sequence[int]]] | None = None,
    num_prompts: int | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """u [P, G] for cfg.response_weight: expected needs sampling_logprob_sums [P, G], count needs
    completion_ids [P][G], none needs num_prompts and group_size (all ones). Then cfg.renorm."""
    if cfg.response_weight == "expected":
        if sampling_logprob_sums is None:
            raise ValueError("reco response_weight=expected needs the sampling log-probs of every completion")
        u = expected_occurrence_weights(sampling_logprob_sums)
    elif cfg.response_weight == "count":
        if completion_ids is None:
            raise ValueError("reco response_weight=count needs the completions' token ids")
        u = duplicate_count_weights(completion_ids)
    elif cfg.response_weight == "none":
        if num_prompts is None or group_size is None:
            raise ValueError("reco response_weight=none needs num_prompts and group_size")
        u = torch.ones(num_prompts, group_size)
    else:
        raise ValueError(f"unknown reco response_weight {cfg.response_weight!r}")
    return renormalise(u) if cfg.renorm else u


def frequent_fraction(sampling_logprob_sums: torch.Tensor) -> float:
    """The fraction of completions with G pi_b(o|x) > 1, i.e. u < 1 (worth logging: on long
    chains of thought it is ~0 and the response weight is a no-op)."""
    g = sampling_logprob_sums.shape[1]
    return float((sampling_logprob_sums.double() + math.log(g) > 0).double().mean())


@torch.no_grad()
def gini_impurity(
    logits: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    group=None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """g = 1 - sum_v pi(v)^2 per position, [N] fp32, from this rank's vocab slice logits
    [N, V_local] (see _vocab: TP group or None, padding columns past vocab_size excluded).
    `temperature`: the one pi_old's log-probs use. The [N, V] probabilities never exist whole:
    chunk_size positions at a time (3 all-reduces of [chunk] tensors each under TP)."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in _vocab.chunks(logits.shape[0], chunk_size):
        z = _vocab.scaled_logits(logits[rows], vocab_size=vocab_size, group=group, temperature=temperature)
        logp = _vocab.log_softmax(z, group)
        square_sum = _vocab.sum_over_ranks(torch.exp(2 * logp).sum(dim=-1), group)
        out[rows] = (1.0 - square_sum).clamp(min=0.0)
    return out


def bernoulli_impurity(old_logp: torch.Tensor) -> torch.Tensor:
    """token_scale=bernoulli: g = pi_old(a)(1 - pi_old(a)) from the sampled tokens' log-probs [T]."""
    x = old_logp.detach()
    p = torch.exp(x if x.dtype == torch.float64 else x.float())
    return p * (1 - p)


def step_mean_terms(
    g: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    seq_weight: torch.Tensor,
) -> tuple[float, float]:
    """One micro-batch's share (sum w g, sum w) of the step mean of g that `token_scale` divides
    by; sum both over the step's micro-batches and DP ranks. g, loss_mask, advantages, seq_index
    are a packed micro-batch's per-position tensors, seq_weight its [S] sequence weights.

    Our choice (docs/methods.md 2.1.3 reads "the mean over the step's valid tokens"): the tokens that carry
    a policy-gradient term, i.e. loss tokens with A != 0, each weighted by its sequence's trained
    weight w = w_q w_o u. Why A != 0: c_t multiplies A, so a zero-advantage token's scale is
    irrelevant, and counting zero-variance groups' tokens would make every c_t depend on whether
    `pruning.drop_zero_variance` removed them before the pi_old pass (it does; with it off they
    have one); this way it does not. Why w: sum w c / sum w = 1 over the trained tokens, so c only
    redistributes the step's loss over its tokens, at GRPO's total weight; under DPPO pruning the
    ratio sum w g / sum w estimates the unpruned step's u-weighted mean (w_q w_o are
    Horvitz-Thompson weights): consistent, not exact, whenever pruning draws."""
    w = torch.where(seq_index >= 0, seq_weight[seq_index.clamp(min=0)], 0.0).double()
    w = w * loss_mask.double() * (advantages != 0).double()
    return float((w * g.double()).sum()), float(w.sum())


def token_scale(g: torch.Tensor, step_mean: float) -> torch.Tensor:
    """c = g / step_mean (no gradient). step_mean: the step's mean of g (`step_mean_terms`), over
    every micro-batch and DP rank, all-reduced before the first update. Guard (docs/methods.md 2.2):
    step_mean <= 1e-8 (every position saturated) gives c = 0, no update, instead of 0/0 (our
    choice)."""
    if step_mean <= MIN_MEAN_IMPURITY:
        return torch.zeros_like(g, dtype=torch.float32)
    return (g.detach().float() / step_mean).float()


def var_ratio_scale(logp: torch.Tensor, old_logp: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """token_scale=var_ratio [guess]: sg[pi(a)(1 - pi(a)) / (pi_old(a)(1 - pi_old(a)))], [T]; the
    denominator is floored at eps (pi_old(a) = 1 exactly would divide by 0)."""
    p, p_old = bernoulli_impurity(logp), bernoulli_impurity(old_logp)
    return p / p_old.clamp(min=eps)


def surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    scale: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_scale: bool = False,
):
    """ReCo's per-token loss, all [T] over loss tokens (losses.py's flat layout) -> (loss [T], stats).

    l_t = -A_t c_t log pi_theta(a_t), c = `scale` (detached). Trust region (our choice): the token
    is zeroed where the PPO clip would zero it, (A > 0 and rho > 1 + clip_high) or (A < 0 and
    rho < 1 - clip_low), rho = pi_theta / pi_old. clip_scale=True (token_scale=var_ratio): the
    coefficient is min(c A, clip(c, 1 - clip_low, 1 + clip_high) A), c in place of rho inside the
    usual clip [guess]. At theta = pi_old (rho = 1, c = 1 for var_ratio) the gradient is GRPO's
    times c. The KL term is unchanged: the caller adds kl_coef * losses.kl_penalty(logp, ref_logp)
    as policy_loss does.
    """
    if not (logp.shape == old_logp.shape == advantages.shape == scale.shape) or logp.dim() != 1:
        raise ValueError(
            "logp, old_logp, advantages and scale must be equal 1-D shapes, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(advantages.shape)}, {tuple(scale.shape)}"
        )
    a, c = advantages.detach().float(), scale.detach().float()
    with torch.no_grad():
        ratio = torch.exp(logp.detach() - old_logp)
        outside = ((a > 0) & (ratio > 1 + clip_high)) | ((a < 0) & (ratio < 1 - clip_low))
        coef = a * c
        if clip_scale:
            coef = torch.minimum(c * a, c.clamp(1 - clip_low, 1 + clip_high) * a)
        coef = coef.masked_fill(outside, 0.0)
    loss = -coef * logp
    stats = {"clip_frac": outside.float(), "ratio": ratio, "scale": c}
    return loss, stats


def check_logprobs_mode(logprobs_mode: str, *, temperature: float, top_p: float, top_k: int = 0) -> None:
    """ReCo's pi_b must be the distribution actually sampled. vLLM's default `raw_logprobs` is
    log_softmax of the raw logits (temperature 1, no top-p/top-k): wrong as soon as sampling
    changes the distribution. One-line error naming the settings."""
    if logprobs_mode == "processed_logprobs":
        return
    if temperature != 1.0 or top_p < 1.0 or top_k > 0:
        raise ValueError(
            f"reco needs the sampled distribution's log-probs: the rollout engine's logprobs_mode is "
            f"{logprobs_mode!r} with rollout.temperature={temperature}, top_p={top_p}, top_k={top_k}; "
            "use logprobs_mode='processed_logprobs'"
        )


def processed_logprobs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The reference for vLLM's processed log-probs, [N, V] from full-vocabulary logits [N, V]:
    logits / temperature, then top-k (values below the k-th largest dropped), then top-p (vLLM's
    rule: sorted ascending, drop the tokens whose cumulative probability is <= 1 - top_p, always
    keeping the most likely), then log_softmax (dropped tokens: -inf)."""
    z = logits.float() / temperature
    if top_k > 0:
        kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        order = z.argsort(dim=-1)
        probs = torch.softmax(z.gather(-1, order), dim=-1)
        drop = probs.cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(z, dim=-1)


def check_processed_logprobs(
    returned: torch.Tensor,
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    atol: float = 2e-3,
) -> None:
    """Compare the engine's returned log-probs of sampled tokens [N] with the processed
    distribution computed from the same model's logits [N, V] (e.g. HF on a tiny example, V the
    real vocabulary) at token_ids [N]. A one-line ValueError says whether they match the RAW
    log-probs instead (the engine was built with logprobs_mode='raw_logprobs')."""
    rows = torch.arange(len(token_ids))
    want = processed_logprobs(logits, temperature=temperature, top_p=top_p, top_k=top_k)[rows, token_ids]
    err = float((returned.float() - want).abs().max())
    if err <= atol:
        return
    raw = torch.log_softmax(logits.float(), dim=-1)[rows, token_ids]
    if float((returned.float() - raw).abs().max()) <= atol:
        raise ValueError(
            f"the sampling log-probs are the RAW distribution's (max error {err:.3g} against the processed one at "
            f"temperature={temperature}, top_p={top_p}, top_k={top_k}): build the engine with "
            "logprobs_mode='processed_logprobs'"
        )
    raise ValueError(
        f"the sampling log-probs differ from the processed distribution by up to {err:.3g} (tolerance {atol})"
    )
