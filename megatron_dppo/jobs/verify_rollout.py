"""Exact check of the rollout correction (algorithm.rollout_correction, docs/algorithm.md section 8).

A toy policy small enough to enumerate: completions of `length` tokens, each drawn independently
from a categorical over `vocab` tokens, pi_old = softmax(theta); the rollout policy mu =
softmax(theta + mismatch * noise) differs from it by a known amount. Every completion o has a
fixed advantage A(o). The target is the on-policy gradient E_{o ~ pi_old}[grad l(o)] of the
library's own loss (losses.policy_loss over the sequence's tokens, seq-mean-token-mean), and each
correction's estimator is the same loss weighted by losses.rollout_correction and taken over
mu's samples: E_{o ~ mu}[grad (w . l)(o)]. Both expectations are sums over all vocab^length
completions, so the bias is computed exactly (no Monte Carlo noise): an estimator is UNBIASED
when its relative bias is below float64 rounding (`tol`), BIASED otherwise.

Expected, and checked by tests/unit/test_rollout_correction.py: untruncated token IS is
unbiased at length 1 (there rho_t is the completion's whole ratio); the untruncated product
(seq_tis) at every length; no correction is biased (the negative control); a cap or a mask
is biased by an amount reported here.

staleness > 0 (trainer.max_staleness with dedicated rollout ranks): the rollout policy is not
pi_old plus noise but pi_old as it was `staleness` updates earlier: theta_prev, and pi_old's theta
is theta_prev moved by `staleness` exact gradient-ascent steps of the expected advantage. The
same verdicts hold: only the size of the mismatch and its structure (along the update) change.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from megatron_dppo.algorithms import losses


@dataclass
class RolloutCheckConfig:
    vocab: int = 6
    length: int = 1  # tokens per completion; token-level IS is exact only at 1
    mismatch: float = 1.0  # std of the rollout policy's logit noise against pi_old
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0
    seed: int = 0
    tol: float = 1e-9  # relative bias below which an exact sum counts as unbiased (float64 rounding)
    staleness: int = 0  # > 0: the rollout policy is pi_old this many updates earlier (module docstring)
    lr: float = 2.0  # those updates' step size on the expected advantage


@dataclass
class RolloutCheckResult:
    kind: str
    length: int
    cap: float
    rel_bias: float  # ||E_mu[estimator] - target|| / ||target||
    unbiased: bool

    def summary(self) -> str:
        bound = "no cap" if math.isinf(self.cap) else f"cap {self.cap:g}"
        bound = bound if self.kind in losses.ROLLOUT_TRUNCATING else ""
        verdict = "UNBIASED" if self.unbiased else "BIASED"
        return f"{self.kind:12s} {bound:8s} length {self.length}: relative bias {self.rel_bias:.3e}: {verdict}"


def _policies(cfg: RolloutCheckConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    theta = torch.randn(cfg.vocab, generator=gen, dtype=torch.float64)
    mu_logits = theta + cfg.mismatch * torch.randn(cfg.vocab, generator=gen, dtype=torch.float64)
    completions = list(itertools.product(range(cfg.vocab), repeat=cfg.length))
    advantages = torch.rand(len(completions), generator=gen, dtype=torch.float64) * 2 - 1
    if cfg.staleness:  # the rollout sampled with the weights before pi_old's last updates
        mu_logits = theta.clone()
        for _ in range(cfg.staleness):
            theta = theta + cfg.lr * _expected_advantage_gradient(theta, completions, advantages)
    return theta, torch.log_softmax(mu_logits, -1), completions, advantages


def stale_kl(cfg: RolloutCheckConfig) -> float:
    """KL(rollout policy || pi_old) per token of the check's policies: how far apart they are."""
    theta, rollout_logp, _, _ = _policies(cfg)
    old = torch.log_softmax(theta, -1)
    return float((rollout_logp.exp() * (rollout_logp - old)).sum())


def _expected_advantage_gradient(theta, completions, advantages) -> torch.Tensor:
    """grad_theta sum_o pi_theta(o) A(o), exactly (an update the policy could have made)."""
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    ids = torch.tensor(completions)
    objective = (logp[ids].sum(-1).exp() * advantages).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def _gradient(theta, rollout_logp_table, tokens, advantage, kind, cfg) -> torch.Tensor:
    """grad_theta of the one completion's corrected loss at theta = theta_old."""
    theta = theta.clone().requires_grad_()
    ids = torch.tensor(tokens)
    logp = torch.log_softmax(theta, -1)[ids]
    seq_index = torch.zeros(len(tokens), dtype=torch.long)
    loss, _ = losses.policy_loss(logp, logp.detach(), torch.full_like(logp, float(advantage)))
    coef = losses.token_coefficients(
        seq_index, torch.ones(1), torch.tensor([len(tokens)]), "seq-mean-token-mean", denominator=1.0
    )
    if kind != "none":
        weight, _ = losses.rollout_correction(
            logp.detach(), rollout_logp_table[ids], seq_index, 1, kind, cap=cfg.cap, low=cfg.low, high=cfg.high
        )
        coef = coef * weight
    (grad,) = torch.autograd.grad(losses.aggregate(loss, coef), theta)
    return grad


def run_rollout_check(cfg: RolloutCheckConfig, kind: str) -> RolloutCheckResult:
    """The exact relative bias of `kind` (its cap from cfg; math.inf = untruncated)."""
    theta, rollout_logp, completions, advantages = _policies(cfg)
    old_logp = torch.log_softmax(theta, -1)
    target = torch.zeros_like(theta)
    estimate = torch.zeros_like(theta)
    for o, a in zip(completions, advantages):
        ids = torch.tensor(o)
        p_old, p_mu = old_logp[ids].sum().exp(), rollout_logp[ids].sum().exp()
        target += p_old * _gradient(theta, rollout_logp, o, a, "none", cfg)
        estimate += p_mu * _gradient(theta, rollout_logp, o, a, kind, cfg)
    rel = float((estimate - target).norm() / target.norm())
    return RolloutCheckResult(kind=kind, length=cfg.length, cap=cfg.cap, rel_bias=rel, unbiased=rel <= cfg.tol)


def run_rollout_checks(cfg: RolloutCheckConfig) -> list[tuple[RolloutCheckResult, bool]]:
    """The report of `megatron-dppo verify-unbiased --rollout-correction`: (result, expected
    verdict; None: biased by design, its size reported) for the untruncated estimators (token IS at
    length 1, and at the config's length where it is not exact; the product at the config's
    length), none (the negative control), and every kind at the config's cap and bounds."""
    from dataclasses import replace

    out = []
    one = replace(cfg, length=1, cap=math.inf)
    out.append((run_rollout_check(one, "tis"), True))
    out.append((run_rollout_check(replace(cfg, cap=math.inf), "seq_tis"), True))
    if cfg.length > 1:  # token IS ignores the other tokens' ratios: biased for a completion's advantage
        out.append((run_rollout_check(replace(cfg, cap=math.inf), "tis"), None))
    out.append((run_rollout_check(cfg, "none"), False))
    for kind in losses.ROLLOUT_CORRECTIONS[1:]:
        out.append((run_rollout_check(cfg, kind), None))
    return out
