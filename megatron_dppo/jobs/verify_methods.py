"""verify-unbiased for the four other methods (docs/methods.md section 5).

Two questions per method, on verify_unbiased's synthetic step (linear policy, binary rewards,
ragged lengths, a prompt history):
  1. Is the method biased against GRPO BY DESIGN? Its unpruned full-batch gradient is compared
     with GRPO's (a deterministic gap; every one of them changes the objective on purpose).
  2. Does DPPO stay unbiased for the METHOD'S OWN full-batch loss? The trainer's planning
     (algorithms/batch.py, with the method on) runs over mask draws, and the mean gradient is
     compared with that full-batch gradient, computed directly, against its Monte Carlo error.
What the synthetic step stands for, per method (our modelling choices):
  reco      each completion gets sampling log-probs (a third of them "frequent": G pi_b > 1), so
            the response weight u acts; each token has a fixed impurity g_t > 0 and c_t = g_t / m,
            m the trainer's step mean (reco.step_mean_terms: over trained tokens with A != 0,
            weighted by w_q w_o u; unpruned: every such token, weighted by u), inside ReCo's own
            per-token loss -A c log pi. Under pruning m is a ratio estimate: consistent, not exact.
  ssopd     each pair's aux gradient (of (1/T_q) sum_t d_t) is a fixed random vector J_aux[q]; the
            pairs and frontier weights are the trainer's (batch.ssopd_pairs), the coefficients
            ssopd.aux_coefficients'. Checked: GRPO + lambda * aux.
  adaprefix the curriculum changes the PROMPTS (a prefix of the reference), not the loss: on the
            assisted prompts the loss is GRPO's, so DPPO's check is GRPO's check.
  bppo      the trainer's selection and prefixes; no completion pruning (r_o = 0 with it), so only
            prompt pruning draws: BPPO's denominator sums the selected prefixes with their w_q, a
            ratio estimate (consistent, not exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from megatron_dppo.algorithms import batch, losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.methods.bppo import rules as bppo
from megatron_dppo.algorithms.methods.reco import rules as reco
from megatron_dppo.algorithms.methods.ssopd import distill
from megatron_dppo.algorithms.methods.ssopd import rules as ssopd
from megatron_dppo.algorithms.pruning import get_strategy
from megatron_dppo.algorithms.records import Group
from megatron_dppo.jobs.verify_unbiased import (
    CheckConfig,
    _compare,
    _method,
    _stats_of,
    _synthetic_step,
    _SyntheticPrompt,
    _token_loss_jacobian,
    _within_tolerance,
    bias_along,
    bias_estimate,
    verdict_text,
)


class _Synthetic:
    """What the synthetic step stands for under a method (the module docstring says why); this
    base is GRPO's: its own loss, no auxiliary term, exact when DPPO's estimate is."""

    why_biased = ""
    comparable = True  # its full-batch gradient can be compared with GRPO's here
    prunes_completions = True  # DPPO's r_o draws with it

    def impurity(self, cfg, seq_index, gen):
        """A fixed per-token scale inside the method's per-token loss, or None."""
        return None

    def full_weights(self, cfg, method, rewards, lengths, sums, seq_w, lens, denom):
        """The unpruned step's (sequence weights, loss lengths, denominator)."""
        return seq_w, lens, denom

    def aux_gradient(self, cfg, method, rewards, lengths, aux):
        """The unpruned step's auxiliary gradient, or None."""
        return None

    def exact(self, cfg) -> bool:
        """DPPO's estimate is exact (judged by z), not a ratio estimate (judged by a tolerance)."""
        return not (cfg.loss_agg == "token-mean" and cfg.r_q > 0)


class _BPPO(_Synthetic):
    why_biased = "it trains the shortest correct and shortest incorrect completions' prefixes only"
    prunes_completions = False

    def full_weights(self, cfg, method, rewards, lengths, sums, seq_w, lens, denom):
        plan = bppo.plan(rewards, lengths, method.selection.cfg, loss_agg=cfg.loss_agg, max_response_length=cfg.max_len)
        return plan.seq_weight, plan.prefix_len, plan.denominator_terms

    def exact(self, cfg):
        return cfg.r_q == 0  # prompt pruning makes its denominator a ratio estimate


class _ReCo(_Synthetic):
    why_biased = "it reweights responses by expected occurrence and tokens by the policy's impurity"

    def impurity(self, cfg, seq_index, gen):
        return 0.5 + torch.rand(seq_index.numel(), generator=gen, dtype=torch.float64)

    def full_weights(self, cfg, method, rewards, lengths, sums, seq_w, lens, denom):
        return reco.expected_occurrence_weights(sums).double(), lens, denom

    def exact(self, cfg):
        # c_t divides by a step mean estimated from the kept tokens: a ratio once pruning draws.
        return super().exact(cfg) and not (cfg.r_q > 0 or cfg.r_o > 0)


class _AdaPrefix(_Synthetic):
    why_biased = "it trains on prompts assisted by a reference prefix (a curriculum)"
    comparable = False


class _SSOPD(_Synthetic):
    why_biased = "it adds a self-distillation term to GRPO's loss"

    def aux_gradient(self, cfg, method, rewards, lengths, aux):
        B = rewards.shape[0]
        sel = ssopd.select_pair(rewards, lengths, terminated=lengths < cfg.max_len)
        omega = ssopd.frontier_weight(rewards) * (sel.correct >= 0)
        return method.aux.cfg.coef * (omega[:, None] * aux).sum(0) / B


# method under check -> its synthetic step (the method's name as its slot's registry knows it)
SYNTHETIC = {"bppo": _BPPO(), "reco": _ReCo(), "adaprefix": _AdaPrefix(), "ssopd": _SSOPD()}
METHODS = tuple(SYNTHETIC)


@dataclass
class MethodCheckResult:
    method: str
    design_gap: float  # ||full-batch gradient of the method - GRPO's|| / ||GRPO's||; nan: not comparable here
    rel_error: float
    rel_std_error: float
    max_z: float
    z_threshold: float
    exact: bool
    unbiased: bool
    bias_along: float = math.nan  # verify_unbiased.bias_along

    def summary(self, cfg: CheckConfig) -> str:
        gap = (
            "not comparable here"
            if math.isnan(self.design_gap)
            else f"full-batch gradients differ by {self.design_gap:.1%}"
        )
        synthetic = SYNTHETIC[self.method]
        r_o = cfg.r_o if synthetic.prunes_completions else 0.0
        return (
            f"{self.method:9s} biased by design vs GRPO ({synthetic.why_biased}; {gap}) | DPPO r_q={cfg.r_q:.2f} "
            f"r_o={r_o:.2f} for its own full-batch loss ({cfg.loss_agg}): "
            f"rel.err {self.rel_error:.4f} +- {self.rel_std_error:.4f} | "
            + verdict_text(self, cfg.approx_tol, judged_by_z=self.exact)
        )


def _masked_gradient(cfg, seq_w, loss_len, seq_index, seq_len, denom, J):
    """sum_t coef_t dl_t/dtheta where only each sequence's first loss_len tokens carry loss (BPPO's
    prefixes) and seq-mean-token-mean divides by loss_len, as the packed micro-batch does."""
    starts = torch.cumsum(seq_len, 0) - seq_len
    position = torch.arange(seq_index.numel()) - starts[seq_index]
    lens = loss_len.flatten()
    coef = losses.token_coefficients(seq_index, seq_w.flatten().double(), lens.clamp(min=1), cfg.loss_agg, denom)
    return (coef.double() * (position < lens[seq_index]).double()) @ J


def _synthetic_rollout(rewards, lengths, sampling_sums, max_len):
    def rollout(rnd, items):
        return [
            Group(
                rec,
                rnd,
                slot,
                [0],
                [[0] * int(n) for n in lengths[rec.index]],
                rewards[rec.index].tolist(),
                prompt_weight=w_q,
                truncated=[int(n) >= max_len for n in lengths[rec.index]],
                sampling_logprobs=[
                    [float(s) / int(n)] * int(n) for s, n in zip(sampling_sums[rec.index], lengths[rec.index])
                ],
            )
            for rec, slot, w_q in items
        ]

    return rollout


def _setting(cfg: CheckConfig, synthetic: _Synthetic, gen):
    """The synthetic step with the method's pieces: (rewards, stats, lengths, J of the method's
    per-token loss, J of GRPO's, seq_index, seq_len, sampling log-prob sums, aux Jacobian)."""
    rewards, stats, lengths = _synthetic_step(cfg, gen)
    adv = group_advantages(rewards, cfg.advantage)
    B, G = rewards.shape
    J_grpo, seq_index, seq_len = _token_loss_jacobian(cfg, adv, lengths, gen)
    frequent = torch.rand(B, G, generator=gen) < 1 / 3
    sums = torch.where(
        frequent, -math.log(G) * torch.rand(B, G, generator=gen), -5.0 - 5.0 * torch.rand(B, G, generator=gen)
    ).double()
    J, impurity = J_grpo, synthetic.impurity(cfg, seq_index, gen)
    if impurity is not None:  # J of -A g log pi: the loss is linear in c, so c = g / m is J / m
        J = _token_loss_jacobian(cfg, adv, lengths, gen, reco_scale=impurity)[0]
    aux = torch.randn(B, J.shape[1], generator=gen, dtype=torch.float64) / math.sqrt(J.shape[1])
    return rewards, stats, lengths, J, J_grpo, seq_index, seq_len, sums, aux, impurity


def _reco_step_mean(cfg, rewards, seq_w, loss_len, seq_index, seq_len, impurity) -> float:
    """m = the trainer's step mean of g (reco.step_mean_terms) for these sequence weights: over
    the loss tokens of sequences with A != 0, each weighted by its sequence weight."""
    adv = group_advantages(rewards, cfg.advantage).flatten()
    starts = torch.cumsum(seq_len, 0) - seq_len
    position = torch.arange(seq_index.numel()) - starts[seq_index]
    w = seq_w.flatten().double()[seq_index] * (position < loss_len.flatten()[seq_index]).double()
    w = w * (adv[seq_index] != 0).double()
    return float((w * impurity).sum() / w.sum()) if float(w.sum()) > 0 else 1.0


def _full_gradient(cfg, synthetic, method, rewards, lengths, sums, J, aux, seq_index, seq_len, impurity=None):
    """The method's unpruned full-batch gradient, computed directly from its definition."""
    B, G = rewards.shape
    lens, seq_w = lengths.clone(), torch.ones(B, G, dtype=torch.float64)
    denom = losses.full_batch_denominator(
        cfg.loss_agg, num_prompts=B, group_size=G, completion_lengths=lengths, max_response_length=cfg.max_len
    )
    seq_w, lens, denom = synthetic.full_weights(cfg, method, rewards, lengths, sums, seq_w, lens, denom)
    grad = _masked_gradient(cfg, seq_w, lens, seq_index, seq_len, denom, J)
    if impurity is not None:
        grad = grad / _reco_step_mean(cfg, rewards, seq_w, lens, seq_index, seq_len, impurity)
    extra = synthetic.aux_gradient(cfg, method, rewards, lengths, aux)
    return grad if extra is None else grad + extra


def _planned_gradient(
    cfg, method, strategy, prompts, stats_of, rollout, gen, J, aux, seq_index, seq_len, rewards=None, impurity=None
):
    """One mask draw through the trainer's planning with the method on."""
    collected = batch.collect(
        method, strategy, next_batch=lambda n: prompts, stats_of=stats_of, rollout=rollout, generator=gen
    )
    batch.weigh_completions(method, strategy, collected.trained, gen)
    plans = batch.plan_minibatches(method, collected.trained, collected.drawn)
    grad = torch.zeros(J.shape[1], dtype=torch.float64)
    if not plans:
        return grad
    B, G = cfg.num_prompts, cfg.group_size
    seq_w, lens = torch.zeros(B, G, dtype=torch.float64), seq_len.reshape(B, G).clone()
    for g in collected.trained:
        seq_w[g.record.index] = torch.tensor([g.train_weight * w for w in g.completion_weights], dtype=torch.float64)
        lens[g.record.index] = torch.tensor(g.loss_lengths())
    grad = _masked_gradient(cfg, seq_w, lens, seq_index, seq_len, plans[0].denominator, J)
    if impurity is not None:
        grad = grad / _reco_step_mean(cfg, rewards, seq_w, lens, seq_index, seq_len, impurity)
    pairs = plans[0].aux_pairs
    if pairs:  # the trainer's coefficients (distill.aux_microbatches), T_q positions of aux[q] / T_q each
        positions = torch.tensor([float(len(p.group.completions[p.wrong])) for p in pairs], dtype=torch.float64)
        coef = distill.pair_coefficients(pairs, positions.tolist(), plans[0].num_prompts, method.aux.cfg.coef)
        rows = torch.tensor([p.group.record.index for p in pairs])
        grad = grad + ((coef * positions)[:, None] * aux[rows]).sum(0)
    return grad


def run_method_check(cfg: CheckConfig) -> MethodCheckResult:
    if cfg.method not in SYNTHETIC:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    synthetic = SYNTHETIC[cfg.method]
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths, J, J_grpo, seq_index, seq_len, sums, aux, impurity = _setting(cfg, synthetic, gen)
    B, G = rewards.shape
    strategy = get_strategy(cfg.strategy)
    method = _method(cfg, strategy, dynamic_sampling=False)
    method = method.replace(prompts_per_round=B, rounds=1, refill=False, redraw_skipped=False, drop_uninformative=False)
    full = _full_gradient(cfg, synthetic, method, rewards, lengths, sums, J, aux, seq_index, seq_len, impurity)
    grpo = _full_gradient(cfg, _Synthetic(), method, rewards, lengths, sums, J_grpo, aux, seq_index, seq_len)
    gap = float((full - grpo).norm() / grpo.norm()) if synthetic.comparable else float("nan")
    prompts = [_SyntheticPrompt(f"q{i}", i) for i in range(B)]
    stats_of, rollout = _stats_of(stats, prompts), _synthetic_rollout(rewards, lengths, sums, cfg.max_len)
    grads = [
        _planned_gradient(
            cfg, method, strategy, prompts, stats_of, rollout, gen, J, aux, seq_index, seq_len, rewards, impurity
        )
        for _ in range(cfg.draws)
    ]
    rel_err, rel_se, max_z, z_limit, _ = _compare(torch.stack(grads), full, cfg.alpha)
    along = bias_along(torch.stack(grads), full)
    exact = synthetic.exact(cfg)
    unbiased = max_z <= z_limit if exact else _within_tolerance(rel_err, rel_se, cfg.approx_tol)
    return MethodCheckResult(cfg.method, gap, rel_err, rel_se, max_z, z_limit, exact, bool(unbiased), along)


def bppo_prompt_pruning_bias(cfg: CheckConfig, draws: int = 100_000, chunk: int = 10_000) -> dict:
    """The bias of BPPO's ratio estimate under DPPO's prompt pruning, without the Monte Carlo
    noise of the planning path. BPPO trains no pruned completions (r_o = 0), so a mask draw's
    gradient is exactly sum_q w_q n_q / sum_q w_q d_q: n_q the prompt's pair gradient over its
    prefixes (the token coefficients without the denominator), d_q its denominator term
    (bppo.denominator_terms), w_q the prompt weight pruning.prompt weights give (0 skipped). The
    draws of w are vectorised (the trainer's _drop_uniformly), so `draws` can be 10-100x the
    planning path's. Returns {"rel_bias", "rel_se", "along", "full"} (relative to the unpruned
    gradient, full = sum n / sum d, which equals _full_gradient's)."""
    from megatron_dppo.algorithms.pruning import _drop_uniformly, prompt_candidates

    cfg = replace(cfg, method="bppo")
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards, stats, lengths, J, _, seq_index, seq_len, _, _, _ = _setting(cfg, SYNTHETIC["bppo"], gen)
    method = _method(cfg, get_strategy(cfg.strategy), dynamic_sampling=False)
    plan = bppo.plan(rewards, lengths, method.selection.cfg, loss_agg=cfg.loss_agg, max_response_length=cfg.max_len)
    B = rewards.shape[0]
    n, d = [], []
    for q in range(B):
        one = torch.zeros(B, dtype=torch.float64)
        one[q] = 1.0
        n.append(_masked_gradient(cfg, plan.seq_weight * one[:, None], plan.prefix_len, seq_index, seq_len, 1.0, J))
        d.append(
            bppo.denominator_terms(
                plan.prefix_len, plan.seq_weight, cfg.loss_agg, prompt_weight=one, max_response_length=cfg.max_len
            )
        )
    n, d = torch.stack(n), torch.tensor(d, dtype=torch.float64)
    full = n.sum(0) / d.sum()
    candidates = prompt_candidates(stats.score)
    grads = []
    for start in range(0, draws, chunk):
        rows = min(chunk, draws - start)
        _, w = _drop_uniformly(candidates[None].expand(rows, B), cfg.r_q, gen)
        num, den = w.double() @ n, w.double() @ d
        grads.append(torch.where(den[:, None] > 0, num / den.clamp(min=1e-300)[:, None], torch.zeros_like(num)))
    grads = torch.cat(grads)
    rel_err, rel_se, *_ = _compare(grads, full, cfg.alpha)
    along = bias_along(grads, full)
    return {"rel_bias": bias_estimate(rel_err, rel_se), "rel_se": rel_se, "along": along, "full": full}
