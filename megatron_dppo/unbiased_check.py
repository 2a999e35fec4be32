"""Monte Carlo check that a pruning strategy keeps the full-batch gradient (DPPO.md section 4).

A synthetic step: B prompts x G completions with binary rewards, a prompt history, ragged
completion lengths, and a linear "policy" logp_t = phi_t . theta (theta in R^D). The per-token
loss is the library's own policy_loss; its Jacobian J [T, D] is computed once. Each mask draw
runs the library's pruning, weights, denominator and token coefficients, and its gradient is
coef @ J (exact, since the aggregated loss is linear in coef). The mean over N draws is
compared with the unpruned gradient, coordinate by coordinate, against its Monte Carlo
standard error.

Dynamic-sampling mode (`run_dynamic_check`, docs/algorithm.md "DAPO + DPPO"): a fixed prompt
stream with fixed rewards per prompt, so unpruned DAPO's batch is exactly the first B
informative prompts of the stream, each with weight 1. Each draw runs the rounds the trainer
runs (draw, prune prompts, drop zero-variance groups, `refill.take_until_full` by weight,
prune completions inside the trained groups, the refill denominator) and is compared with that
batch's gradient, and its total weight with B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.pruning import _drop_uniformly, drop_zero_variance_groups, get_strategy
from megatron_dppo.algorithms.refill import take_until_full

REFILL_RULES = ("weight", "count")


@dataclass
class CheckConfig:
    strategy: str = "dppo"
    num_prompts: int = 16
    group_size: int = 8
    r_q: float = 0.5
    r_o: float = 0.5
    loss_agg: str = "seq-mean-token-mean"
    advantage: str = "grpo"
    ratio_type: str = "token"
    kl_coef: float = 0.0
    ratio_noise: float = 0.3  # spread of log(pi/pi_old) so that clipping is active
    max_len: int = 16
    dim: int = 16
    draws: int = 4000
    seed: int = 0
    alpha: float = 1e-3  # family-wise false-alarm rate of the verdict
    approx_tol: float = 0.05  # allowed relative error where the estimator is only consistent
    # Dynamic-sampling mode only:
    max_resample_rounds: int = 3  # rounds after the first, as algorithm.max_resample_rounds
    refill_by: str = "weight"  # "count": the old double-counting rule (a negative control)
    extreme_frac: float = 0.5  # share of the stream's prompts nearly always right or wrong
    fixed_order: bool = False  # True: one stream order; False: each draw shuffles it (the sampler)
    weight_tol: float = 0.01  # allowed relative gap between the mean total weight and B


@dataclass
class CheckResult:
    rel_error: float
    rel_std_error: float
    max_z: float
    z_threshold: float
    rel_variance: float  # tr(Cov) / ||g_full||^2 of one pruned gradient
    rel_variance_uniform: float  # same for uniform random dropping at the same ratios
    kept_completion_frac: float
    kept_prompt_frac: float
    corrected: bool  # does the strategy reweight what it keeps?
    exact: bool  # is the estimator exactly unbiased in theory?
    unbiased: bool  # the verdict

    def summary(self, cfg: CheckConfig) -> str:
        kind = (
            "exact"
            if self.exact
            else f"consistent (tolerance {cfg.approx_tol:.0%})"
            if self.corrected
            else "no reweighting"
        )
        verdict = "UNBIASED" if self.unbiased else "BIASED"
        return (
            f"{cfg.strategy:8s} {cfg.loss_agg:24s} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} "
            f"kept prompts {self.kept_prompt_frac:5.1%} completions {self.kept_completion_frac:5.1%} | "
            f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.), "
            f"max|z| {self.max_z:6.2f} (limit {self.z_threshold:.2f}) | "
            f"variance {self.rel_variance:.4f} vs uniform dropping {self.rel_variance_uniform:.4f} | "
            f"{kind}: {verdict}"
        )


def _synthetic_step(cfg: CheckConfig, gen: torch.Generator, num_prompts: int | None = None, extreme_frac: float = 0.3):
    B, G = num_prompts or cfg.num_prompts, cfg.group_size
    # A share of the prompts are nearly always wrong or nearly always right (success rate
    # within 0.1 of 0 or 1): mostly zero-variance groups, but not always.
    p = torch.rand(B, generator=gen, dtype=torch.float64)
    extreme = torch.where(p > 0.5, 1 - 0.1 * (1 - p) * 2, 0.1 * p * 2)
    p = torch.where(torch.rand(B, generator=gen, dtype=torch.float64) < extreme_frac, extreme, p)
    rewards = (torch.rand(B, G, generator=gen, dtype=torch.float64) < p[:, None]).float()
    history = PromptHistory()
    ids = [f"q{i}" for i in range(B)]
    for _ in range(2):  # two earlier rollouts, so GRESO sees streaks
        past = (torch.rand(B, G, generator=gen, dtype=torch.float64) < p[:, None]).float()
        history.update(ids, past)
    stats = history.stats(ids)
    unseen = torch.rand(B, generator=gen) < 0.2  # never rolled out: no score
    stats.score[unseen] = math.nan
    for streak in (stats.zero_var_streak, stats.easy_streak, stats.hard_streak):
        streak[unseen] = 0
    lengths = torch.randint(1, cfg.max_len + 1, (B, G), generator=gen)
    return rewards, stats, lengths


def _token_loss_jacobian(cfg, adv, lengths, gen):
    """J [T, D]: d loss_t / d theta for every completion token of the full batch."""
    B, G = adv.shape
    seq_len = lengths.flatten()
    S = seq_len.numel()
    seq_index = torch.repeat_interleave(torch.arange(S), seq_len)
    T = seq_index.numel()
    phi = torch.randn(T, cfg.dim, generator=gen, dtype=torch.float64) / math.sqrt(cfg.dim)
    theta0 = torch.randn(cfg.dim, generator=gen, dtype=torch.float64)
    old_logp = phi @ theta0 + cfg.ratio_noise * torch.randn(T, generator=gen, dtype=torch.float64)
    ref_logp = phi @ theta0 + 0.5 * torch.randn(T, generator=gen, dtype=torch.float64)
    tok_adv = adv.flatten().double()[seq_index]

    def token_loss(theta):
        loss, _ = losses.policy_loss(
            phi @ theta,
            old_logp,
            tok_adv,
            clip_low=0.2,
            clip_high=0.28,
            ratio_type=cfg.ratio_type,
            seq_index=seq_index,
            num_seqs=S,
            ref_logp=ref_logp,
            kl_coef=cfg.kl_coef,
        )
        return loss

    J = torch.autograd.functional.jacobian(token_loss, theta0, vectorize=True)
    return J, seq_index, seq_len


def _gradient(cfg, keep_q, w_q, keep_o, w_o, lengths, seq_index, seq_len, J, kept_norm=False):
    B, G = lengths.shape
    seq_w = (w_q[:, None] * w_o).flatten().double()  # 0 for skipped prompts / dropped completions
    rolled = keep_q.nonzero().flatten()
    if kept_norm:
        denom = losses.kept_denominator(cfg.loss_agg, seq_w, lengths, cfg.max_len)
    else:
        denom = losses.full_batch_denominator(
            cfg.loss_agg,
            num_prompts=B,
            group_size=G,
            completion_lengths=lengths[rolled],
            prompt_weight=w_q[rolled],
            max_response_length=cfg.max_len,
        )
    coef = losses.token_coefficients(seq_index, seq_w, seq_len, cfg.loss_agg, denom).double()
    return coef @ J


def _compare(grads: torch.Tensor, full: torch.Tensor, alpha: float):
    """Mean of the draws vs the reference: (rel. error, rel. MC s.e., max |z|, z limit, rel. variance)."""
    n, dim = grads.shape
    mean, var = grads.mean(0), grads.var(0)
    norm2 = float(full.pow(2).sum())
    diff = mean - full
    se = (var / n).sqrt()
    z = torch.where(
        se > 0, diff.abs() / se.clamp(min=1e-300), torch.where(diff.abs() > 1e-9 * math.sqrt(norm2), math.inf, 0.0)
    )
    z_limit = NormalDist().inv_cdf(1 - alpha / (2 * dim))
    return (
        float(diff.norm()) / math.sqrt(norm2),
        float(se.pow(2).sum().sqrt()) / math.sqrt(norm2),
        float(z.max()),
        z_limit,
        float(var.sum()) / norm2,
    )


def _within_tolerance(rel_err: float, rel_se: float, tol: float) -> bool:
    """A consistent estimator's verdict: its bias, not the Monte Carlo noise, within `tol`.
    ||mean - target||^2 averages bias^2 + se^2, so the bias estimate is sqrt(err^2 - se^2); the
    draws must be enough to see a bias of `tol` (s.e. <= tol / 2), else the verdict is negative."""
    return rel_se <= tol / 2 and math.sqrt(max(rel_err**2 - rel_se**2, 0.0)) <= tol


def run_check(cfg: CheckConfig) -> CheckResult:
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths = _synthetic_step(cfg, gen)
    adv = group_advantages(rewards, cfg.advantage)
    J, seq_index, seq_len = _token_loss_jacobian(cfg, adv, lengths, gen)
    B, G = adv.shape
    ones_q, ones_o = torch.ones(B, dtype=torch.bool), torch.ones(B, G)
    full = _gradient(cfg, ones_q, ones_q.float(), ones_o.bool(), ones_o, lengths, seq_index, seq_len, J)

    strategy = get_strategy(cfg.strategy)
    kept_norm = strategy.denominator == "kept"
    nonzero_group = drop_zero_variance_groups(adv) if cfg.kl_coef == 0 else torch.ones(B, dtype=torch.bool)
    grads, grads_uniform, kept_q, kept_o = [], [], 0.0, 0.0
    for _ in range(cfg.draws):
        keep_q, w_q = strategy.prune_prompts(stats, cfg.r_q, gen)
        keep_o, w_o = strategy.prune_completions(adv, cfg.r_o, gen)
        # Completions of skipped prompts were never generated; all-zero-advantage groups
        # contribute exactly nothing when there is no KL term (the trainer drops them too).
        w_o = w_o * keep_q[:, None] * nonzero_group[:, None]
        grads.append(_gradient(cfg, keep_q, w_q, keep_o, w_o, lengths, seq_index, seq_len, J, kept_norm))
        kept_q += keep_q.float().mean().item()
        kept_o += (w_o > 0).float().mean().item()
        # Reference: the same ratios applied to everything, uniformly (no |A| information).
        uq, uwq = _drop_uniformly(~torch.isnan(stats.score)[None], cfg.r_q, gen)
        uo, uwo = _drop_uniformly(torch.ones(B, G, dtype=torch.bool), cfg.r_o, gen)
        uwo = uwo * uq[0][:, None] * nonzero_group[:, None]
        grads_uniform.append(_gradient(cfg, uq[0], uwq[0], uo, uwo, lengths, seq_index, seq_len, J))
    rel_err, rel_se, max_z, z_limit, rel_var = _compare(torch.stack(grads), full, cfg.alpha)
    exact = strategy.unbiased and not (cfg.loss_agg == "token-mean" and cfg.r_q > 0 and cfg.strategy != "none")
    unbiased = (
        max_z <= z_limit if exact or not strategy.unbiased else _within_tolerance(rel_err, rel_se, cfg.approx_tol)
    )
    return CheckResult(
        rel_error=rel_err,
        rel_std_error=rel_se,
        max_z=max_z,
        z_threshold=z_limit,
        rel_variance=rel_var,
        rel_variance_uniform=_compare(torch.stack(grads_uniform), full, cfg.alpha)[4],
        kept_completion_frac=kept_o / cfg.draws,
        kept_prompt_frac=kept_q / cfg.draws,
        corrected=strategy.unbiased,
        exact=exact,
        unbiased=bool(unbiased),
    )


# ---------------------------------------------------------------------------------------------
# Dynamic sampling (DAPO) with prompt pruning: the refill rule against unpruned DAPO.


@dataclass
class DynamicCheckResult:
    rel_error: float
    rel_std_error: float
    max_z: float
    z_threshold: float
    rel_variance: float
    mean_total_weight: float  # sum of the trained groups' weights, averaged over draws
    target_weight: float  # what unpruned DAPO trains: B (or fewer if its stream runs dry)
    shortfall_frac: float  # draws whose rounds ended before the weight reached B
    rolled_out: float  # prompts rolled out per step (mean) ...
    rolled_out_unpruned: float  # ... and unpruned DAPO's, over the same stream
    exact: bool
    unbiased: bool

    def summary(self, cfg: CheckConfig) -> str:
        kind = "exact" if self.exact else f"consistent (tolerance {cfg.approx_tol:.0%})"
        verdict = "UNBIASED" if self.unbiased else "BIASED"
        order = "fixed stream order" if cfg.fixed_order else "stream shuffled per draw"
        return (
            f"DAPO+{cfg.strategy} refill by {cfg.refill_by}, {order}: {cfg.loss_agg} B={cfg.num_prompts} "
            f"G={cfg.group_size} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} | total weight "
            f"{self.mean_total_weight:.3f} vs {self.target_weight:g} (short of it in {self.shortfall_frac:.1%} "
            f"of draws) | rolled out {self.rolled_out:.1f} prompts vs {self.rolled_out_unpruned:.0f} | "
            f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.), max|z| {self.max_z:6.2f} "
            f"(limit {self.z_threshold:.2f}) | {kind}: {verdict}"
        )


def _dapo_rounds(cfg, strategy, stats, informative, order, gen):
    """One step of DAPO dynamic sampling with the strategy's prompt pruning over the stream
    `order` (prompt indices in stream order). Returns W [N] (each prompt's trained weight, 0 if
    not trained) and the number of prompts rolled out."""
    B = cfg.num_prompts
    per_round = strategy.prompts_to_draw(B, cfg.r_q, cfg.r_o)
    W = torch.zeros(informative.shape[0], dtype=torch.float64)
    filled, count, rolled = 0.0, 0, 0
    for rnd in range(1 + cfg.max_resample_rounds):
        idx = order[rnd * per_round : (rnd + 1) * per_round]
        round_stats = type(stats)(**{k: v[idx] for k, v in vars(stats).items()})
        keep_q, w_q = strategy.prune_prompts(round_stats, cfg.r_q, gen)
        rolled += int(keep_q.sum())
        kept_informative = keep_q & informative[idx]  # every rolled-out group is recorded; these are trained
        groups, weights = idx[kept_informative], w_q[kept_informative].double()
        if cfg.refill_by == "weight":
            take = torch.tensor(take_until_full(weights.tolist(), B, filled), dtype=torch.float64)
        else:  # the old rule: B groups by COUNT, each with its full w_q (skipped prompts counted twice)
            take = weights.clone()
            take[B - count :] = 0
            count += int((take > 0).sum())
        W[groups] = take
        filled += float(take.sum())
        if (filled >= B - 1e-9) if cfg.refill_by == "weight" else count >= B:
            break
    return W, rolled


def run_dynamic_check(cfg: CheckConfig) -> DynamicCheckResult:
    """The stream's prompts and their rewards are fixed. cfg.fixed_order: one stream order, and
    unpruned DAPO's batch is its first B informative prompts. Otherwise each draw also shuffles
    the stream (as the prompt sampler does), and the target is unpruned DAPO's gradient averaged
    over the orders (each draw paired with its own order's unpruned batch)."""
    if cfg.refill_by not in REFILL_RULES:
        raise ValueError(f"refill_by must be one of {REFILL_RULES}, got {cfg.refill_by!r}")
    if cfg.kl_coef != 0:
        raise ValueError(
            "dynamic-sampling mode needs kl_coef = 0: DAPO drops zero-variance groups, "
            "which is exact only without a KL term"
        )
    strategy = get_strategy(cfg.strategy)
    if strategy.refills or strategy.denominator != "full":
        raise ValueError(
            f"dynamic-sampling mode checks reweighting strategies (none, dppo, reverse): "
            f"{cfg.strategy!r} replaces skipped prompts or normalises over what it keeps"
        )
    B, G = cfg.num_prompts, cfg.group_size
    n_stream = strategy.prompts_to_draw(B, cfg.r_q, cfg.r_o) * (1 + cfg.max_resample_rounds)
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths = _synthetic_step(cfg, gen, num_prompts=n_stream, extreme_frac=cfg.extreme_frac)
    adv = group_advantages(rewards, cfg.advantage)
    informative = drop_zero_variance_groups(adv)
    if int(informative.sum()) < B:
        raise ValueError(
            f"the synthetic stream has {int(informative.sum())} informative prompts, fewer than "
            f"B={B}: lower extreme_frac or raise max_resample_rounds"
        )
    J, seq_index, seq_len = _token_loss_jacobian(cfg, adv, lengths, gen)

    def gradient(seq_w, denom):
        return losses.token_coefficients(seq_index, seq_w.flatten(), seq_len, cfg.loss_agg, denom).double() @ J

    def unpruned_dapo(order):
        """Computed directly: the first B informative prompts in stream order, weight 1 each."""
        first = order[informative[order]][:B]
        w = torch.zeros(n_stream, dtype=torch.float64)
        w[first] = 1.0
        denom = losses.refill_denominator(cfg.loss_agg, w[first], lengths[first], G, cfg.max_len)
        last_pos = int((order == first[-1]).nonzero())
        return gradient(w[:, None].expand(n_stream, G), denom), math.ceil((last_pos + 1) / B) * B

    shuffle = not cfg.fixed_order
    fixed_order = torch.arange(n_stream)
    full, rolled_unpruned = unpruned_dapo(fixed_order)
    diffs, refs, totals, rolled, rolled_ref, short = [], [], [], 0, 0, 0
    for _ in range(cfg.draws):
        order = torch.randperm(n_stream, generator=gen) if shuffle else fixed_order
        W, n_rolled = _dapo_rounds(cfg, strategy, stats, informative, order, gen)
        trained = (W > 0).nonzero().flatten()
        seq_w = torch.zeros(n_stream, G, dtype=torch.float64)
        if trained.numel():
            _, w_o = strategy.prune_completions(adv[trained], cfg.r_o, gen)  # inside the trained groups
            seq_w[trained] = W[trained, None] * w_o.double()
        total = float(W.sum())
        if cfg.refill_by == "weight":
            denom = losses.refill_denominator(cfg.loss_agg, W[trained], lengths[trained], G, cfg.max_len)
        else:  # the old trainer's denominators: B*G, B*G*Lmax, Horvitz-Thompson tokens of what it kept
            denom = losses.full_batch_denominator(
                cfg.loss_agg,
                num_prompts=B,
                group_size=G,
                completion_lengths=lengths[trained],
                prompt_weight=W[trained],
                max_response_length=cfg.max_len,
            )
        ref, ref_rolled = unpruned_dapo(order) if shuffle else (full, rolled_unpruned)
        diffs.append(gradient(seq_w, denom) - ref)
        refs.append(ref)
        totals.append(total)
        rolled += n_rolled
        rolled_ref += ref_rolled
        short += total < B - 1e-9
    target = torch.stack(refs).mean(0)
    # The mean of (draw - its own reference) + the target = the draws' mean, compared with the target.
    rel_err, rel_se, max_z, z_limit, rel_var = _compare(torch.stack(diffs) + target, target, cfg.alpha)
    mean_total = sum(totals) / cfg.draws
    # Completion pruning alone keeps the trained groups those of unpruned DAPO: exact. With
    # prompt pruning the stopping round's boundary depends on the masks: consistent.
    exact = strategy.unbiased and cfg.r_q == 0 and cfg.refill_by == "weight"
    if exact or not strategy.unbiased:
        unbiased = max_z <= z_limit
    else:
        # The total weight is exactly B whenever refill succeeds, so a gap means double counting
        # (or refill falling short, which unpruned DAPO, on the same stream, does not).
        unbiased = _within_tolerance(rel_err, rel_se, cfg.approx_tol) and abs(mean_total - B) <= cfg.weight_tol * B
    return DynamicCheckResult(
        rel_error=rel_err,
        rel_std_error=rel_se,
        max_z=max_z,
        z_threshold=z_limit,
        rel_variance=rel_var,
        mean_total_weight=mean_total,
        target_weight=float(B),
        shortfall_frac=short / cfg.draws,
        rolled_out=rolled / cfg.draws,
        rolled_out_unpruned=rolled_ref / cfg.draws,
        exact=exact,
        unbiased=bool(unbiased),
    )
