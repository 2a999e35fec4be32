"""Monte Carlo check that a pruning strategy keeps the full-batch gradient (DPPO.md section 4).

A synthetic step: B prompts x G completions with binary rewards, a prompt history, ragged
completion lengths, and a linear "policy" logp_t = phi_t . theta (theta in R^D). The per-token
loss is the library's own policy_loss; its Jacobian J [T, D] is computed once. Each mask draw
runs the library's pruning, weights, full-batch denominator and token coefficients, and its
gradient is coef @ J (exact, since the aggregated loss is linear in coef). The mean over N
draws is compared with the unpruned gradient, coordinate by coordinate, against its Monte
Carlo standard error.
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
    ratio_noise: float = 0.3     # spread of log(pi/pi_old) so that clipping is active
    max_len: int = 16
    dim: int = 16
    draws: int = 4000
    seed: int = 0
    alpha: float = 1e-3          # family-wise false-alarm rate of the verdict
    approx_tol: float = 0.05     # allowed relative error where the estimator is only consistent


@dataclass
class CheckResult:
    rel_error: float
    rel_std_error: float
    max_z: float
    z_threshold: float
    rel_variance: float          # tr(Cov) / ||g_full||^2 of one pruned gradient
    rel_variance_uniform: float  # same for uniform random dropping at the same ratios
    kept_completion_frac: float
    kept_prompt_frac: float
    corrected: bool              # does the strategy reweight what it keeps?
    exact: bool                  # is the estimator exactly unbiased in theory?
    unbiased: bool               # the verdict

    def summary(self, cfg: CheckConfig) -> str:
        kind = ("exact" if self.exact else f"consistent (tolerance {cfg.approx_tol:.0%})"
                if self.corrected else "no reweighting")
        verdict = "UNBIASED" if self.unbiased else "BIASED"
        return (f"{cfg.strategy:8s} {cfg.loss_agg:24s} r_q={cfg.r_q:.2f} r_o={cfg.r_o:.2f} "
                f"kept prompts {self.kept_prompt_frac:5.1%} completions {self.kept_completion_frac:5.1%} | "
                f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} (MC s.e.), "
                f"max|z| {self.max_z:6.2f} (limit {self.z_threshold:.2f}) | "
                f"variance {self.rel_variance:.4f} vs uniform dropping {self.rel_variance_uniform:.4f} | "
                f"{kind}: {verdict}")


def _synthetic_step(cfg: CheckConfig, gen: torch.Generator):
    B, G = cfg.num_prompts, cfg.group_size
    # A third of the prompts are nearly always wrong or nearly always right (success rate
    # within 0.1 of 0 or 1): mostly zero-variance groups, but not always.
    p = torch.rand(B, generator=gen, dtype=torch.float64)
    extreme = torch.where(p > 0.5, 1 - 0.1 * (1 - p) * 2, 0.1 * p * 2)
    p = torch.where(torch.rand(B, generator=gen, dtype=torch.float64) < 0.3, extreme, p)
    rewards = (torch.rand(B, G, generator=gen, dtype=torch.float64) < p[:, None]).float()
    history = PromptHistory()
    ids = [f"q{i}" for i in range(B)]
    for _ in range(2):  # two earlier rollouts, so GRESO sees streaks
        past = (torch.rand(B, G, generator=gen, dtype=torch.float64) < p[:, None]).float()
        history.update(ids, past)
    stats = history.stats(ids)
    unseen = torch.rand(B, generator=gen) < 0.2  # never rolled out: no score
    stats.score[unseen] = math.nan
    stats.zero_var_streak[unseen] = 0
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
        loss, _ = losses.policy_loss(phi @ theta, old_logp, tok_adv, clip_low=0.2, clip_high=0.28,
                                     ratio_type=cfg.ratio_type, seq_index=seq_index, num_seqs=S,
                                     ref_logp=ref_logp, kl_coef=cfg.kl_coef)
        return loss

    J = torch.autograd.functional.jacobian(token_loss, theta0, vectorize=True)
    return J, seq_index, seq_len


def _gradient(cfg, keep_q, w_q, keep_o, w_o, lengths, seq_index, seq_len, J):
    B, G = lengths.shape
    seq_w = (w_q[:, None] * w_o).flatten().double()  # 0 for skipped prompts / dropped completions
    rolled = keep_q.nonzero().flatten()
    denom = losses.full_batch_denominator(cfg.loss_agg, num_prompts=B, group_size=G,
                                          completion_lengths=lengths[rolled], prompt_weight=w_q[rolled],
                                          max_response_length=cfg.max_len)
    coef = losses.token_coefficients(seq_index, seq_w, seq_len, cfg.loss_agg, denom).double()
    return coef @ J


def run_check(cfg: CheckConfig) -> CheckResult:
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths = _synthetic_step(cfg, gen)
    adv = group_advantages(rewards, cfg.advantage)
    J, seq_index, seq_len = _token_loss_jacobian(cfg, adv, lengths, gen)
    B, G = adv.shape
    ones_q, ones_o = torch.ones(B, dtype=torch.bool), torch.ones(B, G)
    full = _gradient(cfg, ones_q, ones_q.float(), ones_o.bool(), ones_o, lengths, seq_index, seq_len, J)

    strategy = get_strategy(cfg.strategy)
    nonzero_group = drop_zero_variance_groups(adv) if cfg.kl_coef == 0 else torch.ones(B, dtype=torch.bool)
    grads, grads_uniform, kept_q, kept_o = [], [], 0.0, 0.0
    for _ in range(cfg.draws):
        keep_q, w_q = strategy.prune_prompts(stats, cfg.r_q, gen)
        keep_o, w_o = strategy.prune_completions(adv, cfg.r_o, gen)
        # Completions of skipped prompts were never generated; all-zero-advantage groups
        # contribute exactly nothing when there is no KL term (the trainer drops them too).
        w_o = w_o * keep_q[:, None] * nonzero_group[:, None]
        grads.append(_gradient(cfg, keep_q, w_q, keep_o, w_o, lengths, seq_index, seq_len, J))
        kept_q += keep_q.float().mean().item()
        kept_o += (w_o > 0).float().mean().item()
        # Reference: the same ratios applied to everything, uniformly (no |A| information).
        uq, uwq = _drop_uniformly(~torch.isnan(stats.score)[None], cfg.r_q, gen)
        uo, uwo = _drop_uniformly(torch.ones(B, G, dtype=torch.bool), cfg.r_o, gen)
        uwo = uwo * uq[0][:, None] * nonzero_group[:, None]
        grads_uniform.append(_gradient(cfg, uq[0], uwq[0], uo, uwo, lengths,
                                       seq_index, seq_len, J))
    grads = torch.stack(grads)
    mean, var = grads.mean(0), grads.var(0)
    norm2 = float(full.pow(2).sum())
    diff = mean - full
    se = (var / cfg.draws).sqrt()
    z = torch.where(se > 0, diff.abs() / se.clamp(min=1e-300),
                    torch.where(diff.abs() > 1e-9 * math.sqrt(norm2), math.inf, 0.0))
    z_limit = NormalDist().inv_cdf(1 - cfg.alpha / (2 * cfg.dim))
    exact = strategy.unbiased and not (cfg.loss_agg == "token-mean" and cfg.r_q > 0 and cfg.strategy != "none")
    rel_err = float(diff.norm()) / math.sqrt(norm2)
    max_z = float(z.max())
    unbiased = max_z <= z_limit if exact or not strategy.unbiased else rel_err <= cfg.approx_tol
    return CheckResult(
        rel_error=rel_err, rel_std_error=float(se.pow(2).sum().sqrt()) / math.sqrt(norm2),
        max_z=max_z, z_threshold=z_limit, rel_variance=float(var.sum()) / norm2,
        rel_variance_uniform=float(torch.stack(grads_uniform).var(0).sum()) / norm2,
        kept_completion_frac=kept_o / cfg.draws, kept_prompt_frac=kept_q / cfg.draws,
        corrected=strategy.unbiased, exact=exact, unbiased=bool(unbiased))
