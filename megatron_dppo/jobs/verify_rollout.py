"""Exact check of the rollout correction (algorithm.rollout_correction, docs/algorithm.md section 8).

A toy policy small enough to enumerate: completions of `length` tokens, each drawn independently
from a categorical over `vocab` tokens, pi = softmax(theta). Every completion o has a fixed
advantage A(o). The TARGET is the on-policy gradient E_{o ~ pi_old}[grad l(o)] of the library's own
loss (losses.policy_loss over the sequence's tokens, seq-mean-token-mean) with no correction
weight; each correction's ESTIMATE is the same loss weighted by losses.rollout_correction and
taken over the samples of the policy that really sampled: E_{o ~ sampler}[grad (w . l)(o)]. Both
are sums over all vocab^length completions: no Monte Carlo noise.

The trainer's staleness path: the policy has versions v0, v1, ..., each an exact gradient-ascent
step of the expected advantage from the one before; the trained weights (pi_old) are the current
version c = staleness + 1, and the group was sampled by the weights of version c - staleness
(trainer.max_staleness = K with dedicated rollout ranks, any K >= 0: a group trained at step t was
sampled by version >= t - 1 - K, the trained weights being version t - 1; at staleness 0 the same
weights, their rollout log-probs carrying the engine's numerics: logit noise of std `mismatch`).
The check records which version sampled and which one the ratio rho = pi_old / mu is computed
against.

Partial rollouts (`partial`, staleness K >= 1): a weight update arrives while a completion is being
generated and the completion goes on under the new weights. Each completion has a switch point s,
drawn uniformly from 1..length and independently of its tokens: its tokens 1..s were sampled by
version c - K (the oldest the trainer's rule allows) and its tokens after s by version c - K + 1
(s = length: the completion finished before the update, every token by version c - K). Every
token's rollout log-prob is that of the version that sampled it, so rho_t = pi_old(o_t) /
mu_{v(t)}(o_t) and the product over the completion is its whole ratio given s: the untruncated
product stays exact. The group records its oldest token's version (its lag K by the trainer's
rule). The exact sums average over s. The negative control `partial-one-policy` records every
token's log-prob as the newer version's (the tokens before s were sampled by the older one).

Verdict of each kind: its relative bias X = ||estimate - target|| / ||target|| and its BOUND
Y = E_sampler[sum_t coef_t |w_t - rho(o)| ||grad l_t||] / ||target||, rho(o) = prod_t rho_t the
completion's ratio as the weights compute it. When rho is the true ratio, E[rho(o) grad l(o)] is
the target, so X <= Y (the triangle inequality): Y is what the cap cuts off, the mask removes, or
a token weight misses of the completion's ratio. UNBIASED: X within float64 rounding (`tol`);
BIASED (bounded): X <= Y; BIASED beyond the bound: X > Y, possible only when the weights are
not the ratio of the policies that sampled and are trained, an error. The negative controls
(`control`) make exactly that happen: rho inverted (mu / pi_old), rho = 1 (no reweighting while
claiming one), `stale` (sampled by version c - staleness - 1 while rho is computed against
c - staleness, the trainer's record of it; with partial rollouts both versions one older) and
`partial-one-policy` (above).

A recommended kind (RECOMMENDED_CORRECTION, measured by tools/rollout_correction_table.py) must
also be less biased than no correction: a correction that leaves more bias than training as
sampled (token `tis` one update behind on this toy) is an error to recommend.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from megatron_dppo.algorithms import losses
from megatron_dppo.config import AlgorithmConfig

# The lowest-MSE correction per setting (algorithms/losses.RECOMMENDED_CORRECTION, measured by
# tools/rollout_correction_table.py): this toy's completions are short, so at staleness >= 1 it is
# the short completions' kind.
RECOMMENDED_CORRECTION = losses.RECOMMENDED_CORRECTION
NEGATIVE_CONTROLS = ("none", "inverted", "one", "stale", "partial-one-policy")  # none: the check as it should run
PARTIAL_CONTROLS = ("partial-one-policy",)  # the controls that need partial rollouts
_DEFAULTS = AlgorithmConfig()


def recommended_correction(staleness: int, completion_tokens: int | None = None) -> str:
    """The recommended algorithm.rollout_correction for a run at this trainer.max_staleness (the
    toy's short completions unless completion_tokens says otherwise)."""
    return losses.recommended_correction(staleness, completion_tokens)


@dataclass
class RolloutCheckConfig:
    vocab: int = 6
    length: int = 1  # tokens per completion; token-level IS is exact only at 1
    mismatch: float = 1.0  # staleness 0: std of the rollout's logit noise against the sampling weights
    cap: float = _DEFAULTS.rollout_correction_cap
    low: float = _DEFAULTS.rollout_correction_low
    high: float = _DEFAULTS.rollout_correction_high
    seq_low: float = _DEFAULTS.rollout_correction_seq_low
    seq_high: float = _DEFAULTS.rollout_correction_seq_high
    seed: int = 0
    tol: float = 1e-9  # relative bias below which an exact sum counts as unbiased (float64 rounding)
    staleness: int = 0  # updates between the sampling weights and pi_old (module docstring)
    lr: float = 2.0  # each version's step size on the expected advantage
    control: str = "none"  # a negative control of NEGATIVE_CONTROLS (module docstring)
    partial: bool = False  # partial rollouts: two versions sample each completion (module docstring)

    def bounds(self) -> dict:
        return dict(cap=self.cap, low=self.low, high=self.high, seq_low=self.seq_low, seq_high=self.seq_high)


@dataclass
class ToyPolicies:
    """The versions of the toy's policy and which of them sampled, trained, and entered rho."""

    versions: list[torch.Tensor]  # theta of v0 .. v_current
    current: int  # pi_old: the trained weights
    sampled: int  # the version whose weights sampled
    claimed: int  # the version rho's denominator is computed from (the trainer's record)
    old_logp: torch.Tensor  # [V] log pi_old
    sample_logp: torch.Tensor  # [V] the sampler's log-probs (what really drew the tokens)
    rollout_logp: torch.Tensor  # [V] the log-probs the correction divides by
    # Partial rollouts: the version sampling after each completion's switch point (None: none), its
    # log-probs and the ones the correction divides by for those tokens
    newer: int | None = None
    sample_logp_after: torch.Tensor | None = None
    rollout_logp_after: torch.Tensor | None = None
    newer_only: bool = False  # the partial-one-policy control: rho divides by the newer version everywhere

    @property
    def partial(self) -> bool:
        return self.newer is not None

    def token_logps(self, tokens: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sampler's log-prob, the one rho divides by) of each token; before [same shape]: the
        token precedes its completion's switch point (every token, without partial rollouts)."""
        if not self.partial:
            return self.sample_logp[tokens], self.rollout_logp[tokens]
        sample = torch.where(before, self.sample_logp[tokens], self.sample_logp_after[tokens])
        return sample, torch.where(before, self.rollout_logp[tokens], self.rollout_logp_after[tokens])

    @property
    def rho_against(self) -> str:
        """The versions rho's denominators come from, in words."""
        if not self.partial:
            return f"v{self.claimed}"
        if self.newer_only:
            return f"v{self.claimed + 1} for every token"
        return f"v{self.claimed} then v{self.claimed + 1}"

    def describe(self, staleness: int) -> str:
        noise = "" if staleness else " with the engine's numerics (logit noise)"
        if self.partial:
            return (
                f"policy versions v0..v{self.current}: pi_old = v{self.current}, partial rollouts: each completion "
                f"sampled by v{self.sampled} up to its switch point and by v{self.newer} after it, rho computed "
                f"against {self.rho_against}"
            )
        return (
            f"policy versions v0..v{self.current}: pi_old = v{self.current}, sampled by v{self.sampled}{noise}, "
            f"rho computed against v{self.claimed}"
        )


def switch_points(length: int, partial: bool) -> list[tuple[int, float]]:
    """(s, its probability): each completion's tokens 1..s come from the older version, the rest
    from the newer one; without partial rollouts every token is before the switch."""
    if not partial:
        return [(length, 1.0)]
    return [(s, 1.0 / length) for s in range(1, length + 1)]


def policy_versions(theta: torch.Tensor, steps: int, lr: float, objective_gradient) -> list[torch.Tensor]:
    """theta, then `steps` exact gradient-ascent updates of the objective: the run's versions."""
    out = [theta]
    for _ in range(steps):
        out.append(out[-1] + lr * objective_gradient(out[-1]))
    return out


def version_policies(cfg, versions: list[torch.Tensor], noise: torch.Tensor, mismatch: float) -> ToyPolicies:
    """Which version samples and which one rho is computed against, at cfg.staleness and under
    cfg.control (versions: v0 .. v_current, current = staleness + 1 so that the stale control
    has a version one older than the one the run sampled with). With cfg.partial the version one
    newer samples each completion after its switch point."""
    current = len(versions) - 1
    claimed = current - cfg.staleness
    sampled = claimed - 1 if cfg.control == "stale" else claimed
    engine = mismatch * noise if cfg.staleness == 0 else 0.0  # the rollout engine's numerics

    def logp(v):
        return torch.log_softmax(versions[v] + engine, -1)

    policies = ToyPolicies(
        versions=versions,
        current=current,
        sampled=sampled,
        claimed=claimed,
        old_logp=torch.log_softmax(versions[current], -1),
        sample_logp=logp(sampled),
        rollout_logp=logp(claimed),
    )
    if cfg.partial:
        policies.newer = sampled + 1
        policies.sample_logp_after = logp(sampled + 1)
        policies.rollout_logp_after = logp(claimed + 1)
        if cfg.control == "partial-one-policy":  # the trainer records every token as the newer version's
            policies.rollout_logp, policies.newer_only = policies.rollout_logp_after, True
    return policies


def check_control(control: str, staleness: int, partial: bool = False) -> None:
    """A one-line ValueError for a setting the check cannot build."""
    if control not in NEGATIVE_CONTROLS:
        raise ValueError(f"negative control must be one of {NEGATIVE_CONTROLS}, got {control!r}")
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
    if partial and staleness < 1:
        raise ValueError("partial rollouts need staleness >= 1: a weight update mid-generation is one update behind")
    if control in PARTIAL_CONTROLS and not partial:
        raise ValueError(f"negative control {control!r} needs partial rollouts (partial=True, --partial)")


def _toy(cfg: RolloutCheckConfig):
    """(policies, completions [C, L], advantages [C]) of the check's toy."""
    check_control(cfg.control, cfg.staleness, cfg.partial)
    gen = torch.Generator().manual_seed(cfg.seed)
    theta = torch.randn(cfg.vocab, generator=gen, dtype=torch.float64)
    noise = torch.randn(cfg.vocab, generator=gen, dtype=torch.float64)
    completions = torch.tensor(list(itertools.product(range(cfg.vocab), repeat=cfg.length)))
    advantages = torch.rand(len(completions), generator=gen, dtype=torch.float64) * 2 - 1

    def gradient(th):
        return expected_reward_gradient(th, completions, advantages)

    versions = policy_versions(theta, cfg.staleness + 1, cfg.lr, gradient)
    return version_policies(cfg, versions, noise, cfg.mismatch), completions, advantages


def stale_kl(cfg: RolloutCheckConfig, newer: bool = False) -> float:
    """KL(sampler || pi_old) per token of the check's policies: how far apart they are (with
    partial rollouts, of the older sampler, or with `newer` of the one after the switch points)."""
    p, _, _ = _toy(cfg)
    logp = p.sample_logp_after if newer else p.sample_logp
    return float((logp.exp() * (logp - p.old_logp)).sum())


def describe_setting(cfg: RolloutCheckConfig) -> str:
    """The report's header: which versions sampled, trained and entered rho, and how far apart."""
    p, _, _ = _toy(cfg)
    control = "" if cfg.control == "none" else f"NEGATIVE CONTROL {cfg.control} (a self-test: must fail): "
    kl = f"KL(sampler || pi_old) = {stale_kl(cfg):.3g} a token"
    if p.partial:
        older, newer = stale_kl(cfg), stale_kl(cfg, newer=True)
        kl = f"KL(v{p.sampled} || pi_old) = {older:.3g} and KL(v{p.newer} || pi_old) = {newer:.3g} a token"
    return (
        f"{control}{p.describe(cfg.staleness)}; {kl}; target: the on-policy gradient at pi_old (no correction weight)"
    )


def expected_reward_gradient(theta, completions, rewards) -> torch.Tensor:
    """grad_theta sum_o pi_theta(o) r(o), exactly (an update the policy could have made). rewards [C]
    for completions [C, L] of i.i.d. tokens."""
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    objective = (logp[completions].sum(-1).exp() * rewards).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad


def token_jacobian(theta, tokens, seq_index, advantages, num_seqs, ratio_type: str = "token") -> torch.Tensor:
    """J [T, V]: d l_t / d theta of the library's per-token loss at theta = pi_old (ratio 1), the
    tokens' log-probs log_softmax(theta)[tokens]. With the token ratio l_t depends on logp_t alone:
    J_t = (d l_t / d logp_t)(e_{o_t} - p), one backward pass; GSPO's sequence ratio takes the full
    Jacobian."""
    if ratio_type == "token":
        logp = torch.log_softmax(theta, -1)[tokens].requires_grad_()
        loss, _ = losses.policy_loss(logp, logp.detach(), advantages)
        (dloss,) = torch.autograd.grad(loss.sum(), logp)
        score = torch.nn.functional.one_hot(tokens, theta.shape[0]).double() - torch.softmax(theta, -1)
        return dloss[:, None] * score

    def token_loss(th):
        logp = torch.log_softmax(th, -1)[tokens]
        loss, _ = losses.policy_loss(
            logp, logp.detach(), advantages, ratio_type=ratio_type, seq_index=seq_index, num_seqs=num_seqs
        )
        return loss

    return torch.autograd.functional.jacobian(token_loss, theta, vectorize=True)


def correction_weights(old_logp, rollout_logp, seq_index, num_seqs, kind, bounds, control):
    """(w [T], rho [T]: the completion's ratio prod_t rho_t as the weights compute it, at each of
    its tokens) of `kind`, with the negative control's wrong inputs: inverted swaps the two
    log-probs (rho = mu / pi_old), one passes pi_old's as the rollout's (rho = 1)."""
    if control == "inverted":
        old_logp, rollout_logp = rollout_logp, old_logp
    elif control == "one":
        rollout_logp = old_logp
    weight, _ = losses.rollout_correction(old_logp, rollout_logp, seq_index, num_seqs, kind, **bounds)
    seq_log_rho = torch.zeros(num_seqs, dtype=torch.float64).index_add(0, seq_index, (old_logp - rollout_logp).double())
    return weight, seq_log_rho.exp()[seq_index]


@dataclass
class RolloutCheckResult:
    kind: str
    length: int
    cap: float
    rel_bias: float  # X = ||E_sampler[estimator] - target|| / ||target||
    bound: float  # Y (module docstring)
    unbiased: bool  # X <= tol
    sampled_version: int = 0
    claimed_version: int = 0
    current_version: int = 0
    control: str = "none"
    none_bias: float = math.nan  # X of no correction on the same toy (what a correction must beat)
    tol: float = 1e-9

    @property
    def within_bound(self) -> bool:
        return self.rel_bias <= self.bound * (1 + 1e-9) + self.tol

    @property
    def verdict(self) -> str:
        if self.unbiased:
            return "UNBIASED (exact)"
        if self.within_bound:
            return f"BIASED (bounded: {self.rel_bias:.3g} <= {self.bound:.3g})"
        return f"BIASED ({self.rel_bias:.3g} > bound {self.bound:.3g}: the weights are not pi_old / sampler)"

    @property
    def beats_none(self) -> bool:
        """Unbiased, or less biased than training as sampled."""
        return self.unbiased or self.rel_bias < self.none_bias

    def summary(self) -> str:
        bound = "no cap" if math.isinf(self.cap) else f"cap {self.cap:g}"
        bound = bound if self.kind in losses.ROLLOUT_TRUNCATING else ""
        return (
            f"{self.kind:12s} {bound:8s} length {self.length}: relative bias {self.rel_bias:.3e}, "
            f"bound {self.bound:.3e}: {self.verdict}"
        )


def _exact_sums(cfg: RolloutCheckConfig, kind: str):
    """(estimate [V], target [V], bound numerator) of `kind` by summing over every completion."""
    p, completions, advantages = _toy(cfg)
    num, length = completions.shape
    tokens = completions.flatten()
    seq_index = torch.arange(num).repeat_interleave(length)
    theta = p.versions[p.current]
    J = token_jacobian(theta, tokens, seq_index, advantages[seq_index], num)
    coef = losses.token_coefficients(seq_index, torch.ones(num), torch.full((num,), length), "seq-mean-token-mean", 1.0)
    p_old = p.old_logp[completions].sum(-1).exp()

    def per_completion(values):  # [T, ...] -> [C, ...] summed over each completion's tokens
        return torch.zeros((num, *values.shape[1:]), dtype=torch.float64).index_add(0, seq_index, values)

    estimate, deviation = 0.0, 0.0
    for switch, share in switch_points(length, cfg.partial):  # the sampler: a mixture over switch points
        before = (torch.arange(length) < switch).repeat(num)
        sample_logp, rollout_logp = p.token_logps(tokens, before)
        weight, rho = correction_weights(
            p.old_logp[tokens], rollout_logp, seq_index, num, kind, cfg.bounds(), cfg.control
        )
        p_sample = share * sample_logp.view(num, length).sum(-1).exp()
        estimate = estimate + p_sample @ per_completion((coef * weight)[:, None] * J)
        deviation = deviation + p_sample @ per_completion(coef * (weight - rho).abs() * J.norm(dim=1))
    target = p_old @ per_completion(coef[:, None] * J)  # no correction weight: the on-policy gradient
    return estimate, target, float(deviation), p


def run_rollout_check(cfg: RolloutCheckConfig, kind: str, none_bias: float = math.nan) -> RolloutCheckResult:
    """The exact relative bias of `kind` and its bound (its cap from cfg; math.inf = untruncated)."""
    estimate, target, deviation, p = _exact_sums(cfg, kind)
    norm = float(target.norm())
    rel = float((estimate - target).norm()) / norm
    return RolloutCheckResult(
        kind=kind,
        length=cfg.length,
        cap=cfg.cap,
        rel_bias=rel,
        bound=deviation / norm,
        unbiased=rel <= cfg.tol,
        sampled_version=p.sampled,
        claimed_version=p.claimed,
        current_version=p.current,
        control=cfg.control,
        none_bias=none_bias,
        tol=cfg.tol,
    )


@dataclass
class CheckedRow:
    """A line of the report: the result, what it was expected to be, and whether it counts against
    the run (exit 1) and why."""

    result: RolloutCheckResult
    expect_unbiased: bool  # a reference row: the untruncated estimator exact by theory
    role: str = ""  # "recommended" / "checked": the kind must beat no correction

    @property
    def label(self) -> str:
        r = self.result
        cap = (" no cap" if math.isinf(r.cap) else f" cap {r.cap:g}") if r.kind in losses.ROLLOUT_TRUNCATING else ""
        return f"{r.kind}{cap} length {r.length}"

    @property
    def failure(self) -> str:
        r = self.result
        if not r.within_bound:
            return f"{self.label}: bias {r.rel_bias:.3g} beyond its bound {r.bound:.3g}"
        if self.expect_unbiased and not r.unbiased:
            return f"{self.label}: not exact ({r.rel_bias:.3g})"
        if self.role and not r.beats_none:
            if r.kind == "none":
                return f"none ({self.role}): the samples as they are give a biased gradient ({r.rel_bias:.3g})"
            return f"{r.kind} ({self.role}): more biased than no correction ({r.rel_bias:.3g} >= {r.none_bias:.3g})"
        return ""

    def line(self) -> str:
        notes = []
        if self.expect_unbiased:
            notes.append("exact by theory")
        if self.role:
            notes.append(f"{self.role}; no correction's bias {self.result.none_bias:.3g}")
        tail = f" ({', '.join(notes)})" if notes else ""
        return self.result.summary() + tail + (f": COUNTS: {self.failure}" if self.failure else "")


def run_rollout_checks(cfg: RolloutCheckConfig, checked: str | None = None) -> list[CheckedRow]:
    """The report of `megatron-dppo verify-unbiased --rollout-correction`: the untruncated estimators
    that theory says are exact (token IS at length 1, the product at the config's length), then
    every kind at the config's cap and bounds, each with its verdict. The kind recommended for this
    staleness (RECOMMENDED_CORRECTION) and the one under check (`checked`) must beat no correction."""
    none = run_rollout_check(cfg, "none")
    rows = [
        CheckedRow(run_rollout_check(replace(cfg, length=1, cap=math.inf), "tis"), expect_unbiased=True),
        CheckedRow(run_rollout_check(replace(cfg, cap=math.inf), "seq_tis"), expect_unbiased=True),
    ]
    recommended = recommended_correction(cfg.staleness)
    for kind in losses.ROLLOUT_CORRECTIONS:
        result = none if kind == "none" else run_rollout_check(cfg, kind)
        result.none_bias = none.rel_bias
        roles = [r for r, k in (("recommended", recommended), ("checked", checked)) if k == kind]
        rows.append(CheckedRow(result, expect_unbiased=False, role=" and ".join(roles)))
    return rows
