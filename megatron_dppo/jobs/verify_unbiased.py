"""Monte Carlo check that a pruning strategy keeps the full-batch gradient (docs/dppo.md section 4).

A synthetic step: B prompts x G completions with binary rewards, a prompt history, ragged
completion lengths, and a linear "policy" logp_t = phi_t . theta (theta in R^D). The per-token
loss is the library's own policy_loss; its Jacobian J [T, D] is computed once. Each mask draw
runs the TRAINER'S OWN planning (algorithms/batch.py: collect -> weigh_completions ->
plan_minibatches) over a synthetic rollout (the rewards and lengths fixed above), and its
gradient is coef @ J (exact, since the aggregated loss is linear in coef). The mean over N draws
is compared with the unpruned gradient, computed directly (every completion weight 1 over the
full batch's denominator), coordinate by coordinate, against its Monte Carlo standard error.

The static check looks at one round of B prompts: a strategy's over-sampling (CPPO's
B / (1 - P) prompts) and refill (GRESO's) are fixed off there; refill is what the dynamic check
measures.

Dynamic-sampling mode (`run_dynamic_check`, docs/algorithm.md "DAPO + DPPO"): a fixed prompt
stream with fixed rewards per prompt, so unpruned DAPO's batch is exactly the first B
informative prompts of the stream, each with weight 1. Each draw runs the trainer's rounds
(batch.collect with dynamic sampling: draw, prune prompts, drop zero-variance groups, refill by
weight; then completion pruning inside the trained groups and the refill denominator) and is
compared with that batch's gradient, and its total weight with B.

Rollout-correction mode (`run_correction_check`, docs/algorithm.md sections 8 and 10): the
completions are SAMPLED each draw, by the rollout policy of a small toy (verify_rollout.py's policy
versions: at staleness k >= 0 the weights of version current - k), pruned and weighted by the trainer's
planning, and each token's loss weighted by algorithm.rollout_correction; the target is the
on-policy gradient, the mean over batches sampled by pi_old itself of the full batch's gradient
without pruning and without a correction weight. So a wrong weight cannot cancel out. With
partial rollouts (`partial`, k >= 1; verify_rollout.py's docstring) each completion draws its
switch point s uniformly from 1..3 independently of its tokens: its tokens up to s come from
version current - k, the rest from version current - k + 1, and each token's rollout log-prob is
its own sampler's; the group records the oldest version (lag k by the trainer's rule).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import torch

from megatron_dppo.algorithms import batch, losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.methods import registry
from megatron_dppo.algorithms.methods.reco import rules as reco
from megatron_dppo.algorithms.pruning import _drop_uniformly, drop_zero_variance_groups, get_strategy
from megatron_dppo.algorithms.records import Group, policy_lags

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
    overlong_filter: bool = False  # DAPO's filter: completions of max_len tokens are truncated, no loss
    method: str = "grpo"  # verify_methods.run_method_check: bppo | reco | adaprefix | ssopd
    # algorithm.rollout_correction: run_correction_check samples the completions from the rollout
    # policy of a toy (verify_rollout.py's versions) and compares the pruned, corrected gradient with
    # the on-policy one. rollout_noise: at staleness 0, the std of the rollout engine's logit noise
    rollout_correction: str = "none"
    rollout_noise: float = 0.3
    rollout_correction_cap: float | None = None  # None: the config's default; math.inf: untruncated
    # > 0: the completions were sampled by the weights of version current - staleness (dedicated
    # rollout ranks at trainer.max_staleness=1), each version an exact update of size rollout_lr
    staleness: int = 0
    rollout_lr: float = 4.5
    negative_control: str = "none"  # verify_rollout.NEGATIVE_CONTROLS: inverted / one / stale / ... (a self-test)
    partial: bool = False  # partial rollouts: two versions sample each completion (verify_rollout.py)
    without_prompt_weight: bool = False  # negative control: the strategy's kept prompts get w_q = 1
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
    bias_along: float = math.nan  # (mean - full) . full / ||full||^2: the bias's signed share along full

    def summary(self, cfg: CheckConfig) -> str:
        return (
            f"{cfg.strategy:8s} {cfg.loss_agg:24s} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} "
            f"{'overlong filter ' if cfg.overlong_filter else ''}"
            f"{'WITHOUT w_q (negative control) ' if cfg.without_prompt_weight else ''}"
            f"kept prompts {self.kept_prompt_frac:5.1%} completions {self.kept_completion_frac:5.1%} | "
            f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.) | "
            f"variance {self.rel_variance:.4f} vs uniform dropping {self.rel_variance_uniform:.4f} | "
            + verdict_text(self, cfg.approx_tol, judged_by_z=self.exact or not self.corrected)
        )


def bias_estimate(rel_err: float, rel_se: float) -> float:
    """The relative bias ||E[mean] - target|| / ||target|| estimated from the draws:
    ||mean - target||^2 averages bias^2 + se^2, so sqrt(err^2 - se^2) (0 when noise explains it)."""
    return math.sqrt(max(rel_err**2 - rel_se**2, 0.0))


def verdict_text(res, tol: float, *, judged_by_z: bool) -> str:
    """The verdict and the test that decided it, in words that read true. judged_by_z: an exact
    estimator (or one that claims no correction): the per-coordinate z-test at the family-wise
    rate alpha decides. Otherwise the estimator is consistent (a ratio: its bias is O(1/B), never
    0, so enough draws always resolve it and a z-test would reject it): the bias test decides,
    the estimated bias within `tol` with the draws' s.e. <= tol / 2; max|z| is then printed only
    to say whether the draws resolved the bias, and bias_along gives its sign (< 0: the mean
    gradient is shorter than the target along it)."""
    verdict = "UNBIASED" if res.unbiased else "BIASED"
    z = f"max|z| {res.max_z:.2f} {'<=' if res.max_z <= res.z_threshold else '>'} limit {res.z_threshold:.2f}"
    if judged_by_z:
        kind = "exact" if res.exact else "no reweighting"
        return f"{kind}, decided by the z-test: {z}: {verdict}"
    bias, along = bias_estimate(res.rel_error, res.rel_std_error), res.bias_along
    resolved = "resolved by the draws" if res.max_z > res.z_threshold else "not resolved by the draws"
    return (
        f"consistent, decided by the bias test: bias {bias:.2%} (along the target {along:+.2%}; {resolved}: {z}) "
        f"{'<=' if bias <= tol else '>'} tolerance {tol:.0%} at s.e. {res.rel_std_error:.2%} "
        f"{'<=' if res.rel_std_error <= tol / 2 else '>'} {tol / 2:.1%}: {verdict}"
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


def _token_loss_jacobian(cfg, adv, lengths, gen, reco_scale=None):
    """J [T, D]: d loss_t / d theta for every completion token of the full batch. reco_scale [T]:
    ReCo's per-token loss -A c_t log pi (with that fixed c) in place of the clipped surrogate."""
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
        if reco_scale is not None:
            logp = phi @ theta
            loss, _ = reco.surrogate(logp, old_logp, tok_adv, reco_scale, clip_low=0.2, clip_high=0.28)
            return loss.double() + cfg.kl_coef * losses.kl_penalty(logp, ref_logp)
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


@dataclass(frozen=True)
class _SyntheticPrompt:
    """A prompt of the synthetic stream: its history id and its row in the rewards/lengths."""

    id: str
    index: int


def _method(cfg: CheckConfig, strategy, *, dynamic_sampling: bool) -> batch.Method:
    """The trainer's Method for the check's settings (one mini-batch, one epoch)."""
    from megatron_dppo.config import Config

    c = Config()
    c.algorithm.advantage, c.algorithm.loss_agg, c.algorithm.kl_coef = cfg.advantage, cfg.loss_agg, cfg.kl_coef
    c.algorithm.dynamic_sampling, c.algorithm.max_resample_rounds = dynamic_sampling, cfg.max_resample_rounds
    c.algorithm.overlong_filter = cfg.overlong_filter
    slot = registry.slot_of(cfg.method)  # the method of docs/methods.md under check (verify_methods.py)
    if slot is not None:
        setattr(c.algorithm, slot, cfg.method)
    c.algorithm.ssopd.min_positions = 1  # the synthetic step's completions are short
    c.pruning.r_q, c.pruning.r_o = cfg.r_q, cfg.r_o
    c.pruning.drop_zero_variance = cfg.kl_coef == 0  # config.resolve's default
    c.trainer.prompts_per_step = cfg.num_prompts
    c.rollout.group_size, c.rollout.max_new_tokens = cfg.group_size, cfg.max_len
    return batch.Method.from_config(c, strategy)


def _synthetic_rollout(rewards: torch.Tensor, lengths: torch.Tensor, max_len: int, version: int = 0):
    """The trainer's rollout callback, answered from fixed rewards and completion lengths (a
    completion of max_len tokens ran into the budget: truncated); each group records the weights'
    version that (the trainer believes) sampled it, Group.policy_version."""

    def rollout(rnd: int, items: list[tuple]) -> list[Group]:
        return [
            Group(
                record=rec,
                round=rnd,
                slot=slot,
                prompt_ids=[0],
                completions=[[0] * int(n) for n in lengths[rec.index]],
                rewards=rewards[rec.index].tolist(),
                prompt_weight=w_q,
                truncated=[int(n) >= max_len for n in lengths[rec.index]],
                policy_version=version,
            )
            for rec, slot, w_q in items
        ]

    return rollout


def _stats_of(stats, prompts: list[_SyntheticPrompt]):
    """history.stats for the synthetic stream: the rows of the fixed stats by prompt id."""
    row = {p.id: p.index for p in prompts}

    def stats_of(ids):
        idx = torch.tensor([row[i] for i in ids], dtype=torch.long)
        return type(stats)(**{k: v[idx] for k, v in vars(stats).items()})

    return stats_of


def _trainers_draw(cfg, method, strategy, next_batch, stats_of, rollout, gen, jac, select=None, denominator=None):
    """One mask draw through the trainer's planning: collect (rounds, prompt pruning, selection),
    weigh_completions, plan_minibatches; then the gradient of the loss it would train (each
    completion's weight from its group, train_weight x w_o, over the plan's denominator, with
    the library's token coefficients). `denominator` replaces the plan's (the negative control).
    jac: (seq_index, seq_len, J) of the synthetic step. Returns (gradient, the Collected groups)."""
    seq_index, seq_len, J = jac
    collected = batch.collect(
        method, strategy, next_batch=next_batch, stats_of=stats_of, rollout=rollout, generator=gen, select=select
    )
    batch.weigh_completions(method, strategy, collected.trained, gen)
    plans = batch.plan_minibatches(method, collected.trained, collected.drawn)
    if not plans:  # nothing trained
        return torch.zeros(J.shape[1], dtype=torch.float64), collected
    denom = denominator(plans[0].groups) if denominator else plans[0].denominator
    seq_w = torch.zeros(seq_len.numel() // cfg.group_size, cfg.group_size, dtype=torch.float64)
    seq_w[[g.record.index for g in collected.trained]] = batch.sequence_weights(collected.trained)
    coef = losses.token_coefficients(seq_index, seq_w.flatten(), seq_len, cfg.loss_agg, denom)
    return coef.double() @ J, collected


def _direct_gradient(cfg, seq_w, lengths, w_q_rolled, rolled, seq_index, seq_len, J):
    """A reference computed without the planning module: sequence weights seq_w [N, G] (every
    prompt of the synthetic step or stream) over the full batch's denominator (B prompts;
    token-mean over the tokens of the rolled-out ones, `rolled`, weighted by w_q_rolled). With the
    overlong filter, truncated completions (max_len tokens) carry no weight and no tokens."""
    if cfg.overlong_filter:
        kept = lengths < cfg.max_len
        seq_w, lengths = seq_w * kept, lengths * kept
    denom = losses.full_batch_denominator(
        cfg.loss_agg,
        num_prompts=cfg.num_prompts,
        group_size=cfg.group_size,
        completion_lengths=lengths[rolled],
        prompt_weight=w_q_rolled,
        max_response_length=cfg.max_len,
    )
    return losses.token_coefficients(seq_index, seq_w.flatten().double(), seq_len, cfg.loss_agg, denom).double() @ J


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
    """A consistent estimator's verdict: its bias (`bias_estimate`), not the Monte Carlo noise,
    within `tol`; the draws must be enough to see a bias of `tol` (s.e. <= tol / 2), else the
    verdict is negative."""
    return rel_se <= tol / 2 and bias_estimate(rel_err, rel_se) <= tol


def bias_along(grads: torch.Tensor, full: torch.Tensor) -> float:
    """(mean of the draws - full) . full / ||full||^2: the signed part of the relative error along
    the target (< 0: the mean gradient is shorter than the target)."""
    return float((grads.mean(0) - full) @ full) / float(full @ full)


def without_prompt_weight(strategy):
    """The negative control of prompt pruning: the same strategy, its kept prompts trained with
    w_q = 1 instead of their Horvitz-Thompson weight (the check must call it BIASED)."""

    class WithoutPromptWeight(type(strategy)):
        def prune_prompts(self, stats, ratio, generator=None):
            keep, _ = super().prune_prompts(stats, ratio, generator)
            return keep, keep.float()

    control = WithoutPromptWeight.__new__(WithoutPromptWeight)
    control.__dict__.update(vars(strategy))
    return control


def run_check(cfg: CheckConfig):
    """The static check; with a rollout correction or staleness, run_correction_check's."""
    if cfg.rollout_correction != "none" or cfg.staleness or cfg.negative_control != "none" or cfg.partial:
        return run_correction_check(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths = _synthetic_step(cfg, gen)
    adv = group_advantages(rewards, cfg.advantage)
    J, seq_index, seq_len = _token_loss_jacobian(cfg, adv, lengths, gen)
    B, G = adv.shape
    all_q = torch.ones(B, dtype=torch.bool)
    full = _direct_gradient(cfg, torch.ones(B, G), lengths, torch.ones(B), all_q, seq_index, seq_len, J)

    strategy = get_strategy(cfg.strategy)
    if cfg.without_prompt_weight:
        strategy = without_prompt_weight(strategy)
    # One round of exactly the B prompts (module docstring): no over-sampling, no refill.
    method = _method(cfg, strategy, dynamic_sampling=False)
    method = method.replace(prompts_per_round=B, rounds=1, refill=False, redraw_skipped=False, drop_uninformative=False)
    prompts = [_SyntheticPrompt(f"q{i}", i) for i in range(B)]
    stats_of, rollout = _stats_of(stats, prompts), _synthetic_rollout(rewards, lengths, cfg.max_len)
    nonzero_group = drop_zero_variance_groups(adv) if cfg.kl_coef == 0 else torch.ones(B, dtype=torch.bool)
    grads, grads_uniform, kept_q, kept_o = [], [], 0.0, 0.0
    for _ in range(cfg.draws):
        grad, collected = _trainers_draw(
            cfg, method, strategy, lambda n: prompts, stats_of, rollout, gen, (seq_index, seq_len, J)
        )
        grads.append(grad)
        kept_q += len(collected.rolled) / B
        kept_o += sum(w > 0 for g in collected.trained for w in g.completion_weights) / (B * G)
        # Reference: the same ratios applied to everything, uniformly (no |A| information).
        uq, uwq = _drop_uniformly(~torch.isnan(stats.score)[None], cfg.r_q, gen)
        uo, uwo = _drop_uniformly(torch.ones(B, G, dtype=torch.bool), cfg.r_o, gen)
        seq_w = uwq[0][:, None] * uwo * uq[0][:, None] * nonzero_group[:, None]
        grads_uniform.append(_direct_gradient(cfg, seq_w, lengths, uwq[0][uq[0]], uq[0], seq_index, seq_len, J))
    rel_err, rel_se, max_z, z_limit, rel_var = _compare(torch.stack(grads), full, cfg.alpha)
    along = bias_along(torch.stack(grads), full)
    exact = strategy.unbiased and not (cfg.loss_agg == "token-mean" and cfg.r_q > 0 and "r_q" in strategy.ratios)
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
        bias_along=along,
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
    bias_along: float = math.nan
    corrected: bool = True

    def summary(self, cfg: CheckConfig) -> str:
        order = "fixed stream order" if cfg.fixed_order else "stream shuffled per draw"
        return (
            f"DAPO+{cfg.strategy} refill by {cfg.refill_by}, {order}: {cfg.loss_agg} B={cfg.num_prompts} "
            f"G={cfg.group_size} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} | total weight "
            f"{self.mean_total_weight:.3f} vs {self.target_weight:g} (short of it in {self.shortfall_frac:.1%} "
            f"of draws) | rolled out {self.rolled_out:.1f} prompts vs {self.rolled_out_unpruned:.0f} | "
            f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.) | "
            + verdict_text(self, cfg.approx_tol, judged_by_z=self.exact or not self.corrected)
            + ("" if self.exact or not self.corrected else f" and total weight within {cfg.weight_tol:.0%} of B")
        )


def _select_by_count(method: batch.Method, groups: list[Group], num_drawn: int, count: float):
    """The negative control (refill_by="count"), the old rule: B groups by COUNT, each trained
    with its full w_q, so a skipped prompt is both represented (w_q) and replaced (a new draw)."""
    chosen = [g for g in groups if g.informative()][: max(method.batch_size - int(count), 0)]
    for g in chosen:
        g.train_weight, g.minibatch = g.prompt_weight, 0
    return chosen, count + len(chosen)


def _count_rule_denominator(cfg: CheckConfig, trained: list[Group]) -> float:
    """The old trainer's denominators under refill by count: B*G, B*G*Lmax, or the
    Horvitz-Thompson tokens of what it kept."""
    lengths = torch.tensor([g.completion_lengths() for g in trained], dtype=torch.float64)
    return losses.full_batch_denominator(
        cfg.loss_agg,
        num_prompts=cfg.num_prompts,
        group_size=cfg.group_size,
        completion_lengths=lengths.reshape(len(trained), cfg.group_size),
        prompt_weight=torch.tensor([g.train_weight for g in trained], dtype=torch.float64),
        max_response_length=cfg.max_len,
    )


def _stream(prompts: list[_SyntheticPrompt], order: torch.Tensor):
    """next_batch over the stream in `order` (as the sampler hands out prompts)."""
    pos = 0

    def next_batch(n: int):
        nonlocal pos
        out = [prompts[i] for i in order[pos : pos + n].tolist()]
        pos += n
        return out

    return next_batch


def _unpruned_dapo(cfg: CheckConfig, order, informative, lengths, jac):
    """Computed directly, without the planning module: unpruned DAPO trains the first B informative
    prompts in stream order, weight 1 each. Returns (its gradient, the prompts it rolled out)."""
    seq_index, seq_len, J = jac
    B = cfg.num_prompts
    first = order[informative[order]][:B]
    seq_w = torch.zeros(lengths.shape, dtype=torch.float64)
    seq_w[first] = 1.0
    grad = _direct_gradient(cfg, seq_w, lengths, torch.ones(B), first, seq_index, seq_len, J)
    last_pos = int((order == first[-1]).nonzero())
    return grad, math.ceil((last_pos + 1) / B) * B


def _dynamic_strategy(cfg: CheckConfig):
    """The strategy, if the dynamic check can judge it (ValueError saying why not)."""
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
    return strategy


def run_dynamic_check(cfg: CheckConfig) -> DynamicCheckResult:
    """The stream's prompts and their rewards are fixed. cfg.fixed_order: one stream order, and
    unpruned DAPO's batch is its first B informative prompts. Otherwise each draw also shuffles
    the stream (as the prompt sampler does), and the target is unpruned DAPO's gradient averaged
    over the orders (each draw paired with its own order's unpruned batch)."""
    strategy = _dynamic_strategy(cfg)
    method = _method(cfg, strategy, dynamic_sampling=True)
    B = cfg.num_prompts
    n_stream = method.prompts_per_round * method.rounds
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
    prompts = [_SyntheticPrompt(f"q{i}", i) for i in range(n_stream)]
    stats_of, rollout = _stats_of(stats, prompts), _synthetic_rollout(rewards, lengths, cfg.max_len)

    def unpruned_dapo(order):
        return _unpruned_dapo(cfg, order, informative, lengths, (seq_index, seq_len, J))

    shuffle = not cfg.fixed_order
    fixed_order = torch.arange(n_stream)
    full, rolled_unpruned = unpruned_dapo(fixed_order)
    select = batch.select_groups if cfg.refill_by == "weight" else _select_by_count
    diffs, refs, totals, rolled, rolled_ref, short = [], [], [], 0, 0, 0
    for _ in range(cfg.draws):
        order = torch.randperm(n_stream, generator=gen) if shuffle else fixed_order
        denom = (lambda groups: _count_rule_denominator(cfg, groups)) if cfg.refill_by == "count" else None
        jac = (seq_index, seq_len, J)
        next_batch = _stream(prompts, order)
        grad, collected = _trainers_draw(
            cfg, method, strategy, next_batch, stats_of, rollout, gen, jac, select=select, denominator=denom
        )
        ref, ref_rolled = unpruned_dapo(order) if shuffle else (full, rolled_unpruned)
        diffs.append(grad - ref)
        refs.append(ref)
        total = sum(g.train_weight for g in collected.trained)
        totals.append(total)
        rolled += len(collected.rolled)
        rolled_ref += ref_rolled
        short += total < B - 1e-9
    return _dynamic_result(cfg, strategy, diffs, refs, totals, rolled, rolled_ref, short)


def _dynamic_result(cfg, strategy, diffs, refs, totals, rolled, rolled_ref, short) -> DynamicCheckResult:
    """The dynamic check's numbers and verdict from its draws."""
    B = cfg.num_prompts
    target = torch.stack(refs).mean(0)
    # The mean of (draw - its own reference) + the target = the draws' mean, compared with the target.
    rel_err, rel_se, max_z, z_limit, rel_var = _compare(torch.stack(diffs) + target, target, cfg.alpha)
    along = bias_along(torch.stack(diffs) + target, target)
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
        bias_along=along,
        corrected=strategy.unbiased,
    )


# ---------------------------------------------------------------------------------------------
# The rollout correction with pruning: completions sampled by the rollout policy, against the
# on-policy gradient (docs/algorithm.md sections 8 and 10).

CORRECTION_VOCAB, CORRECTION_LENGTH = 6, 3  # the toy's completions: 3 tokens over 6 (216 of them)


@dataclass
class _CorrectionToy:
    policies: object  # verify_rollout.ToyPolicies
    rewards: torch.Tensor  # [B, C] each prompt's reward of each completion (0 or 1)
    stats: object  # the prompt history's stats, fixed before the step (as the trainer's)


def _correction_toy(cfg: CheckConfig) -> _CorrectionToy:
    """A policy over 3-token completions shared by B prompts, each prompt with its own 0/1 reward of
    each completion; its versions are exact updates of the mean expected reward (verify_rollout)."""
    from megatron_dppo.jobs import verify_rollout as vr

    gen = torch.Generator().manual_seed(cfg.seed)
    _, stats, _ = _synthetic_step(cfg, gen)
    theta = torch.randn(CORRECTION_VOCAB, generator=gen, dtype=torch.float64)
    noise = torch.randn(CORRECTION_VOCAB, generator=gen, dtype=torch.float64)
    completions = torch.tensor(list(itertools.product(range(CORRECTION_VOCAB), repeat=CORRECTION_LENGTH)))
    success = torch.rand(cfg.num_prompts, 1, generator=gen, dtype=torch.float64)
    rewards = (torch.rand(cfg.num_prompts, len(completions), generator=gen, dtype=torch.float64) < success).double()

    def gradient(th):
        return vr.expected_reward_gradient(th, completions, rewards.mean(0))

    versions = vr.policy_versions(theta, cfg.staleness + 1, cfg.rollout_lr, gradient)
    control = vr.RolloutCheckConfig(staleness=cfg.staleness, control=cfg.negative_control, partial=cfg.partial)
    return _CorrectionToy(vr.version_policies(control, versions, noise, cfg.rollout_noise), rewards, stats)


def _sample_batch(toy: _CorrectionToy, cfg: CheckConfig, logp: torch.Tensor, gen: torch.Generator):
    """B x G completions drawn from the categorical exp(logp): (tokens [B*G*L], rewards [B, G])."""
    B, G, L = cfg.num_prompts, cfg.group_size, CORRECTION_LENGTH
    tokens = torch.multinomial(logp.exp(), B * G * L, replacement=True, generator=gen).view(B, G, L)
    return _with_rewards(toy, tokens)


def _with_rewards(toy: _CorrectionToy, tokens: torch.Tensor):
    """(tokens [B*G*L], rewards [B, G]) of completions tokens [B, G, L]."""
    L = tokens.shape[-1]
    index = (tokens * CORRECTION_VOCAB ** torch.arange(L - 1, -1, -1)).sum(-1)
    return tokens.flatten(), toy.rewards.gather(1, index)


def _sample_rollout(toy: _CorrectionToy, cfg: CheckConfig, gen: torch.Generator):
    """A batch as the rollout sampled it: (tokens [T], rewards [B, G], before [T] or None). With
    partial rollouts each completion's switch point s is uniform over 1..L, independent of its
    tokens; `before` marks its tokens 1..s (sampled by the older version, the rest by the newer)."""
    p = toy.policies
    if not p.partial:
        return (*_sample_batch(toy, cfg, p.sample_logp, gen), None)
    B, G, L = cfg.num_prompts, cfg.group_size, CORRECTION_LENGTH
    switch = torch.randint(1, L + 1, (B, G, 1), generator=gen)
    before = torch.arange(L) < switch  # [B, G, L]
    older = torch.multinomial(p.sample_logp.exp(), B * G * L, replacement=True, generator=gen).view(B, G, L)
    newer = torch.multinomial(p.sample_logp_after.exp(), B * G * L, replacement=True, generator=gen).view(B, G, L)
    return (*_with_rewards(toy, torch.where(before, older, newer)), before.flatten())


def _toy_jacobian(toy, cfg, tokens, rewards):
    """(J [T, V] of the library's per-token loss at pi_old, seq_index, seq_len) for a sampled batch."""
    from megatron_dppo.jobs.verify_rollout import token_jacobian

    S = rewards.numel()
    seq_len = torch.full((S,), CORRECTION_LENGTH)
    seq_index = torch.arange(S).repeat_interleave(CORRECTION_LENGTH)
    adv = group_advantages(rewards, cfg.advantage).flatten().double()
    p = toy.policies
    J = token_jacobian(p.versions[p.current], tokens, seq_index, adv[seq_index], S, cfg.ratio_type)
    return J, seq_index, seq_len


@dataclass
class CorrectionCheckResult:
    rel_error: float  # ||mean pruned corrected - mean on-policy|| / ||on-policy||
    rel_std_error: float  # both sides' Monte Carlo s.e.
    max_z: float
    z_threshold: float
    bound: float  # E[sum_t coef_t |w_t - rho(o)| ||grad l_t||] / ||target|| over the full batches
    kept_completion_frac: float
    kept_prompt_frac: float
    exact: bool  # pruning exact and the weights the completions' ratios in every draw
    pruning_exact: bool
    corrected: bool  # the strategy reweights what it keeps
    sampled_version: int
    claimed_version: int
    current_version: int
    max_lag: int  # by the trainer's rule, from the versions the groups record
    unbiased: bool  # no bias beyond the noise (exact), or none the draws resolve beyond the bound
    error: str  # why the line counts against the run ("" if it does not)
    allowed: float = 0.0  # the bound, + the tolerance where pruning is only consistent
    bias_along: float = math.nan
    newer_version: int | None = None  # partial rollouts: the version sampling after the switch points
    rho_against: str = ""  # partial rollouts: the versions rho divides by (ToyPolicies.rho_against)

    def summary(self, cfg: CheckConfig) -> str:
        kind = cfg.rollout_correction
        numerics = "" if cfg.staleness else " with the engine's numerics"
        control = "" if cfg.negative_control == "none" else f" NEGATIVE CONTROL {cfg.negative_control}:"
        bias = bias_estimate(self.rel_error, self.rel_std_error)
        z = f"max|z| {self.max_z:.2f} {'<=' if self.max_z <= self.z_threshold else '>'} limit {self.z_threshold:.2f}"
        if self.exact:
            how = "exact" if self.corrected else "no reweighting"
            verdict = f"{how}, decided by the z-test: {z}: {'UNBIASED' if self.unbiased else 'BIASED'}"
        elif self.max_z <= self.z_threshold:
            verdict = f"bias not resolved by the draws ({z}; bound {self.bound:.3g}): UNBIASED"
        else:
            tol = "" if self.pruning_exact else f" + tolerance {cfg.approx_tol:.0%}"
            head = f"bias {bias:.3g} +- {self.rel_std_error:.2g} ({z})"
            if bias <= self.allowed:
                verdict = f"{head} <= bound {self.bound:.3g}{tol}: BIASED (bounded: {bias:.3g} <= {self.bound:.3g})"
            elif self.unbiased:
                verdict = (
                    f"{head} > bound {self.bound:.3g}{tol} by less than {self.z_threshold:.2f} s.e.: BIASED "
                    "(beyond its bound by less than the noise: more draws decide)"
                )
            else:
                verdict = f"{head} > bound {self.bound:.3g}{tol} by more than {self.z_threshold:.2f} s.e.: "
                verdict += "BIASED beyond its bound"
        sampled, against = f"v{self.sampled_version}{numerics}", f"v{self.claimed_version}"
        if self.newer_version is not None:
            sampled = f"v{self.sampled_version} up to each completion's switch point and v{self.newer_version} after it"
            against = self.rho_against
        return (
            f"{cfg.strategy:8s} {cfg.loss_agg:24s} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} +{control} {kind} "
            f"(advantage {cfg.advantage}), sampled by {sampled}, rho against "
            f"{against}, "
            f"pi_old v{self.current_version} (policy lag {self.max_lag} by the trainer's rule) | kept prompts "
            f"{self.kept_prompt_frac:5.1%} completions {self.kept_completion_frac:5.1%} | against the on-policy "
            f"gradient: rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.) | {verdict}"
        )


def _compare_two(estimates: torch.Tensor, references: torch.Tensor, alpha: float):
    """The draws' mean against the references' mean (independent draws): (rel. error, rel. s.e.,
    max |z|, z limit, target)."""
    n, dim = estimates.shape
    target = references.mean(0)
    diff = estimates.mean(0) - target
    se = (estimates.var(0) / n + references.var(0) / len(references)).sqrt()
    z = diff.abs() / se.clamp(min=1e-300)
    norm = float(target.norm())
    z_limit = NormalDist().inv_cdf(1 - alpha / (2 * dim))
    return float(diff.norm()) / norm, float(se.square().sum().sqrt()) / norm, float(z.max()), z_limit, target


def _correction_draw(cfg, toy, method, strategy, prompts, stats_of, gen):
    """One step as the trainer takes it: a batch sampled by the sampling weights, its groups
    recording the claimed version, the strategy's pruning and weights, each token's loss weighted
    by the correction. -> (gradient, bound's numerator, collected, full-batch coefficients)."""
    from megatron_dppo.jobs.verify_rollout import RolloutCheckConfig, correction_weights

    p = toy.policies
    tokens, rewards, before = _sample_rollout(toy, cfg, gen)
    J, seq_index, seq_len = _toy_jacobian(toy, cfg, tokens, rewards)
    S = rewards.numel()
    bounds = RolloutCheckConfig().bounds()  # the config's defaults
    if cfg.rollout_correction_cap is not None:
        bounds["cap"] = cfg.rollout_correction_cap
    _, rollout_logp = p.token_logps(tokens, before)  # each token's own sampler's (the trainer's record)
    weight, rho = correction_weights(
        p.old_logp[tokens], rollout_logp, seq_index, S, cfg.rollout_correction, bounds, cfg.negative_control
    )
    lengths = torch.full(rewards.shape, CORRECTION_LENGTH)  # never the budget: nothing truncated
    rollout = _synthetic_rollout(rewards, lengths, CORRECTION_LENGTH + 1, version=p.claimed)
    grad, collected = _trainers_draw(
        cfg, method, strategy, lambda n: prompts, stats_of, rollout, gen, (seq_index, seq_len, J * weight[:, None])
    )
    full_coef = _full_coefficients(cfg, seq_index, seq_len)
    deviation = float((full_coef * (weight - rho).abs() * J.norm(dim=1)).sum())
    return grad, deviation, collected


def _full_coefficients(cfg, seq_index, seq_len) -> torch.Tensor:
    """Every completion weight 1 over the full batch's denominator (the unpruned loss's coef)."""
    B, G = cfg.num_prompts, cfg.group_size
    denom = losses.full_batch_denominator(
        cfg.loss_agg,
        num_prompts=B,
        group_size=G,
        completion_lengths=seq_len.view(B, G),
        prompt_weight=torch.ones(B),
        max_response_length=CORRECTION_LENGTH,
    )
    return losses.token_coefficients(seq_index, torch.ones(B * G), seq_len, cfg.loss_agg, denom)


def _on_policy_draw(cfg, toy, gen) -> torch.Tensor:
    """The target's draw: a batch sampled by pi_old itself, the full batch, no pruning, no weight."""
    p = toy.policies
    tokens, rewards = _sample_batch(toy, cfg, p.old_logp, gen)
    J, seq_index, seq_len = _toy_jacobian(toy, cfg, tokens, rewards)
    return _full_coefficients(cfg, seq_index, seq_len) @ J


def _check_correction_config(cfg: CheckConfig) -> None:
    from megatron_dppo.jobs.verify_rollout import check_control

    check_control(cfg.negative_control, cfg.staleness, cfg.partial)
    if cfg.kl_coef != 0:
        raise ValueError(
            "the rollout-correction check needs kl_coef 0: the correction weighs the policy-gradient term "
            "only (losses.corrected_aggregate), so a KL term's gradient keeps the rollout policy's expectation"
        )
    if cfg.rollout_correction not in losses.ROLLOUT_CORRECTIONS:
        raise ValueError(
            f"rollout_correction must be one of {losses.ROLLOUT_CORRECTIONS}, got {cfg.rollout_correction!r}"
        )


def run_correction_check(cfg: CheckConfig) -> CorrectionCheckResult:
    """DPPO (cfg.strategy) with algorithm.rollout_correction, completions sampled by the rollout
    policy (the version the trainer's staleness path samples with; verify_rollout.version_policies),
    against the ON-POLICY target: the mean, over batches sampled by pi_old itself, of the full
    batch's unpruned gradient with no correction weight. Exact when the pruning is and the weights
    are the completions' ratios in every draw (the untruncated product with a group-mean advantage:
    the group mean's share vanishes in expectation): then the z-test decides. Otherwise the bias
    must stay within the correction's bound (the weights' distance from the completion's ratio,
    verify_rollout's Y, here over the full batches), beyond the draws' noise."""
    _check_correction_config(cfg)
    cfg = replace(cfg, max_len=CORRECTION_LENGTH, overlong_filter=False)
    toy = _correction_toy(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    strategy = get_strategy(cfg.strategy)
    method = _method(cfg, strategy, dynamic_sampling=False)
    B = cfg.num_prompts
    method = method.replace(prompts_per_round=B, rounds=1, refill=False, redraw_skipped=False, drop_uninformative=False)
    prompts = [_SyntheticPrompt(f"q{i}", i) for i in range(B)]
    stats_of = _stats_of(toy.stats, prompts)
    grads, refs, deviations, lags, kept_q, kept_o = [], [], [], [], 0.0, 0.0
    for _ in range(cfg.draws):
        grad, deviation, collected = _correction_draw(cfg, toy, method, strategy, prompts, stats_of, gen)
        grads.append(grad)
        deviations.append(deviation)
        # the trainer's rule (Trainer._check_staleness): at step t the trained weights are version t - 1
        lags += policy_lags(collected.trained, toy.policies.current)
        kept_q += len(collected.rolled) / B
        kept_o += sum(w > 0 for g in collected.trained for w in g.completion_weights) / (B * cfg.group_size)
        refs.append(_on_policy_draw(cfg, toy, gen))
    draws = (torch.stack(grads), torch.stack(refs), deviations, lags, kept_q, kept_o)
    return _correction_result(cfg, toy, strategy, *draws)


def _correction_result(cfg, toy, strategy, grads, refs, deviations, lags, kept_q, kept_o) -> CorrectionCheckResult:
    rel_err, rel_se, max_z, z_limit, target = _compare_two(grads, refs, cfg.alpha)
    bound = sum(deviations) / len(deviations) / float(target.norm())
    ratio_estimate = cfg.loss_agg == "token-mean" and cfg.r_q > 0 and "r_q" in strategy.ratios
    pruning_exact = strategy.unbiased and not ratio_estimate
    exact = (pruning_exact and bound <= 1e-12) or not strategy.unbiased
    allowed = bound + (0.0 if pruning_exact else cfg.approx_tol)
    if exact:
        unbiased, error = max_z <= z_limit, "" if max_z <= z_limit else "bias beyond the Monte Carlo noise"
    else:
        # Only a bias the draws resolve beyond the bound counts (bias - z * s.e. > bound): no false alarm.
        excess = bias_estimate(rel_err, rel_se) - z_limit * rel_se > allowed and max_z > z_limit
        unbiased, error = not excess, "bias beyond its bound" if excess else ""
    p = toy.policies
    return CorrectionCheckResult(
        rel_error=rel_err,
        rel_std_error=rel_se,
        max_z=max_z,
        z_threshold=z_limit,
        bound=bound,
        kept_completion_frac=kept_o / cfg.draws,
        kept_prompt_frac=kept_q / cfg.draws,
        exact=exact,
        pruning_exact=pruning_exact,
        corrected=strategy.unbiased,
        sampled_version=p.sampled,
        claimed_version=p.claimed,
        current_version=p.current,
        max_lag=max(lags, default=0),
        unbiased=bool(unbiased),
        error=error,
        allowed=allowed,
        bias_along=bias_along(grads, target),
        newer_version=p.newer,
        rho_against=p.rho_against,
    )
