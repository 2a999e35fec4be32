"""Bias, variance and MSE of each rollout correction on a toy policy (docs/algorithm.md section 8).

    .venv/bin/python tools/rollout_correction_table.py [--seeds 10] [--lengths 4 16 64]
        [--samples 200000] [--batch 2048] [--out docs/rollout_correction_table.json]

The question it answers: which algorithm.rollout_correction gives the most accurate gradient,
for the two ways the sampling policy mu differs from the trained pi_old:

  staleness  mu = pi_old one update earlier (trainer.max_staleness=1): pi_old's logits are mu's
             moved by one exact gradient-ascent step of the expected reward, its size set so that
             KL(mu || pi_old) a token is the one measured at staleness 1 (docs/scaling.md 2d:
             rollout KL k3 8.2e-4 on examples/tiny/longtail.yaml).
  bf16       mu = pi_old with logit noise (a bf16 rollout of a float32 policy), its size set so
             that the ratio's range over a batch of ~500 sampled tokens (its 0.2% and 99.8%
             quantiles under mu) spans the measured [0.977, 1.032] (docs/gpus.md's bf16 table); the KL it
             then has is printed beside it (measured there: 9.1e-5 a token).

The toy: completions of L tokens over a vocabulary of V, position t drawn from softmax(theta_t)
(each position its own distribution, as each position of an LLM's completion has its own
context); reward 1 when the completion's score sum_t a[t, o_t] (a in {0, 1, 2}) reaches a
threshold, else 0 (a completion-level reward: no token's ratio alone is the completion's); the
advantage A(o) = r(o) - E_mu[r] (what GRPO's group mean of the sampled rewards estimates; a
constant baseline moves no estimator's expectation, only its variance). The gradient estimate of one
completion is the library's: the gradient of sum_t coef_t w_t l_t with l_t = losses.policy_loss
(ratio 1 at pi_old), coef_t = losses.token_coefficients (seq-mean-token-mean) and w_t =
losses.rollout_correction(kind) at the config's default bounds (config/schema.py
AlgorithmConfig). The target is the on-policy gradient E_{o ~ pi_old}[g_none(o)], computed
exactly (a dynamic programme over the score). For each kind:

  bias     ||E_mu[g_kind] - target|| / ||target||
  variance tr Cov_mu(g_kind) / ||target||^2          (of one completion's estimate)
  MSE      bias^2 + variance / N                      (a batch of N completions)

N = 2048 (the paper's B*G = 256 x 8; --batch), and the JSON adds N = 256 (the tiny configs' 32 x 8).
Where V^L is small (L = 4: 1296 completions) the expectations are exact sums; otherwise Monte
Carlo over --samples completions of mu, one set for every kind, with the bias measured against
the exact importance-sampling identity E_mu[rho(o) g_none(o)] = target (rho(o) the completion's
ratio): bias = mean of g_kind - rho g_none, whose Monte Carlo error is small wherever the
weight is close to rho. Each Monte Carlo number comes with its standard error.

The recommendation for a setting is the kind with the lowest MSE relative to no correction's,
averaged over seeds and lengths (the table also says in how many (seed, length) cases each kind
had the lowest MSE).
megatron_dppo/jobs/verify_rollout.RECOMMENDED_CORRECTION holds it; tests/unit/
test_rollout_correction_table.py checks that it is the JSON's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.config import AlgorithmConfig  # noqa: E402

KINDS = losses.ROLLOUT_CORRECTIONS
VOCAB = 6
SCORE_LEVELS = 3  # a[t, v] in {0, 1, 2}
STALE_KL = 8.2e-4  # docs/scaling.md 2d: rollout KL k3 at trainer.max_staleness=1 (tiny longtail)
BF16_RHO = (0.977, 1.032)  # docs/gpus.md: bfloat16 rollout of the tiny dense model, rho's range over a batch
RANGE_SHARE = 0.002  # the range of a batch of ~1 / RANGE_SHARE sampled tokens: these quantiles
SETTINGS = ("staleness", "bf16")
EXACT_MAX = 5000  # enumerate every completion when V^L is at most this
CHUNK_TOKENS = 320_000  # Monte Carlo tokens per pass (memory: that * V float64 per kind)


def default_bounds() -> dict:
    """The correction's bounds as the config's defaults (AlgorithmConfig), by rollout_correction's keywords."""
    a = AlgorithmConfig()
    return dict(
        cap=a.rollout_correction_cap,
        low=a.rollout_correction_low,
        high=a.rollout_correction_high,
        seq_low=a.rollout_correction_seq_low,
        seq_high=a.rollout_correction_seq_high,
    )


@dataclass
class Toy:
    old_logp: torch.Tensor  # [L, V] log pi_old at each position
    mu_logp: torch.Tensor  # [L, V] log mu (the policy that sampled)
    score: torch.Tensor  # [L, V] integer score of each token at each position
    threshold: int  # reward 1 when the score sum reaches it
    baseline: float  # E_mu[r]: the sampled group's mean reward, in expectation
    kl: float  # KL(mu || pi_old) a token (mean over positions)

    @property
    def length(self) -> int:
        return self.old_logp.shape[0]

    def rho_range(self) -> tuple[float, float]:
        return rho_range(self.old_logp, self.mu_logp)


def rho_range(old_logp: torch.Tensor, mu_logp: torch.Tensor, share: float = RANGE_SHARE) -> tuple[float, float]:
    """The `share` and 1 - `share` quantiles of rho = pi_old / mu over mu's tokens ([L, V] tables,
    positions alike): about the min and max of a batch of 1 / share sampled tokens."""
    rho = (old_logp - mu_logp).exp().flatten()
    order = rho.argsort()
    cdf = (mu_logp.exp().flatten() / old_logp.shape[0])[order].cumsum(0)
    return float(rho[order][cdf >= share][0]), float(rho[order][cdf <= 1 - share][-1])


def score_distribution(probs: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """P(sum_t score[t, o_t] = s) for s = 0..max, positions independent (probs [L, V])."""
    top = int(score.max()) * probs.shape[0]
    dist = torch.zeros(top + 1, dtype=torch.float64)
    dist[0] = 1.0
    for p, a in zip(probs, score):
        step = torch.zeros(SCORE_LEVELS, dtype=torch.float64).index_add(0, a, p)
        dist = torch.nn.functional.conv1d(dist[None, None], step.flip(0)[None, None], padding=SCORE_LEVELS - 1)[0, 0]
        dist = dist[: top + 1]
    return dist


def _tail(dist: torch.Tensor, threshold: int) -> torch.Tensor:
    return dist[max(threshold, 0) :].sum() if threshold < len(dist) else torch.zeros((), dtype=torch.float64)


def reward_gradient(logits: torch.Tensor, score: torch.Tensor, threshold: int) -> torch.Tensor:
    """d E_theta[r] / d theta [L, V] exactly: p_tv (P(r = 1 | o_t = v) - P(r = 1)) (the score
    function's identity), each conditional from the score distribution of the other positions."""
    probs = logits.softmax(-1)
    p_r = _tail(score_distribution(probs, score), threshold)
    grad = torch.zeros_like(probs)
    for t in range(len(probs)):
        others = score_distribution(torch.cat([probs[:t], probs[t + 1 :]]), torch.cat([score[:t], score[t + 1 :]]))
        for v in range(probs.shape[1]):
            grad[t, v] = probs[t, v] * (_tail(others, threshold - int(score[t, v])) - p_r)
    return grad


def target_gradient(toy: Toy) -> torch.Tensor:
    """E_{o ~ pi_old}[g_none(o)], flattened [L * V]: the library's loss gradient at ratio 1 is
    -coef A(o) sum_t (e_{o_t} - p_t) with coef = 1/L (seq-mean-token-mean), and the baseline's
    share vanishes (E[e_{o_t} - p_t] = 0), so it is -(1/L) d E[r] / d theta."""
    return -reward_gradient(toy.old_logp, toy.score, toy.threshold).flatten() / toy.length


def _kl(mu_logits: torch.Tensor, old_logits: torch.Tensor) -> float:
    mu, old = mu_logits.log_softmax(-1), old_logits.log_softmax(-1)
    return float((mu.exp() * (mu - old)).sum(-1).mean())


def _solve_scale(measure_of_scale, target: float, power: float) -> float:
    """The scale s with measure_of_scale(s) = target, for a measure that grows about as s^power
    (fixed-point steps on s)."""
    s = 1.0
    for _ in range(30):
        s *= (target / measure_of_scale(s)) ** (1 / power)
    return s


def _log_width(old_logits: torch.Tensor, mu_logits: torch.Tensor) -> float:
    lo, hi = rho_range(old_logits.log_softmax(-1), mu_logits.log_softmax(-1))
    return math.log(hi / lo)


def make_toy(setting: str, length: int, seed: int, vocab: int = VOCAB) -> Toy:
    """The toy of `setting` (module docstring) for one seed."""
    gen = torch.Generator().manual_seed(1000 * seed + length)
    theta = torch.randn(length, vocab, generator=gen, dtype=torch.float64)
    score = torch.randint(0, SCORE_LEVELS, (length, vocab), generator=gen)
    dist = score_distribution(theta.softmax(-1), score)
    quantile = 0.3 + 0.4 * float(torch.rand((), generator=gen, dtype=torch.float64))
    threshold = int((dist.cumsum(0) < quantile).sum())  # P(r = 1) about 1 - quantile under theta
    noise = torch.randn(length, vocab, generator=gen, dtype=torch.float64)
    if setting == "staleness":  # theta is mu, the weights one update back; pi_old = after the update
        step = reward_gradient(theta, score, threshold)
        mu, old = theta, theta + _solve_scale(lambda s: _kl(theta, theta + s * step), STALE_KL, 2) * step
    elif setting == "bf16":  # theta is pi_old; the rollout's logits carry noise
        width = math.log(BF16_RHO[1] / BF16_RHO[0])
        old, mu = theta, theta + _solve_scale(lambda s: _log_width(theta, theta + s * noise), width, 1) * noise
    else:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    old_logp, mu_logp = old.log_softmax(-1), mu.log_softmax(-1)
    baseline = float(_tail(score_distribution(mu_logp.exp(), score), threshold))
    return Toy(old_logp, mu_logp, score, threshold, baseline, _kl(mu, old))


def completion_gradients(toy: Toy, tokens: torch.Tensor, kinds, weight_fn=None) -> tuple[dict, torch.Tensor]:
    """Each completion's gradient estimate under each kind ({kind: [S, L * V]}) and its ratio rho(o) [S].
    tokens [S, L]. weight_fn: losses.rollout_correction unless a test injects a wrong one."""
    weight_fn = weight_fn or losses.rollout_correction
    num, length = tokens.shape
    pos = torch.arange(length).expand(num, length)
    old, mu = toy.old_logp[pos, tokens].flatten(), toy.mu_logp[pos, tokens].flatten()
    seq_index = torch.arange(num).repeat_interleave(length)
    score = toy.score[pos, tokens].sum(-1)
    advantage = (score >= toy.threshold).double() - toy.baseline
    logp = old.clone().requires_grad_()
    loss, _ = losses.policy_loss(logp, old, advantage[seq_index])  # ratio 1: the gradient at pi_old
    (dloss,) = torch.autograd.grad(loss.sum(), logp)  # token ratio: l_t depends on logp_t alone
    coef = losses.token_coefficients(seq_index, torch.ones(num), torch.full((num,), length), "seq-mean-token-mean", 1.0)
    # d logp_t / d theta_t = e_{o_t} - p_t (the other positions' logits do not enter)
    score_fn = torch.nn.functional.one_hot(tokens, toy.old_logp.shape[1]).double() - toy.old_logp.exp()[None]
    base = (coef * dloss).view(num, length, 1) * score_fn
    out = {}
    for kind in kinds:
        weight, _ = weight_fn(old, mu, seq_index, num, kind, **default_bounds())
        out[kind] = (weight.view(num, length, 1) * base).flatten(1)
    return out, (old - mu).view(num, length).sum(-1).exp()


@dataclass
class Moments:
    """Running sums over completions (weighted by p/q for an exact sum: weight = probability)."""

    total: float = 0.0
    mean: torch.Tensor | None = None  # sum w g
    sq: float = 0.0  # sum w ||g||^2
    quad: float = 0.0  # sum w ||g||^4 (the variance's Monte Carlo error)
    dev: torch.Tensor | None = None  # sum w (g - rho g_none)
    dev_sq: torch.Tensor | None = None  # sum w (g - rho g_none)^2 per coordinate
    # sum w (||g||^2 - ||g_none||^2) and of its square: the variance against no correction's, paired
    # (the same completions), whose Monte Carlo error is far below either variance's own
    paired: float = 0.0
    paired_sq: float = 0.0

    def add(self, weight: torch.Tensor, g: torch.Tensor, d: torch.Tensor, g_none: torch.Tensor) -> None:
        norm2 = g.square().sum(-1)
        diff = norm2 - g_none.square().sum(-1)
        self.paired += float(weight @ diff)
        self.paired_sq += float(weight @ diff.square())
        parts = (weight @ g, weight @ d, weight @ d.square())
        if self.mean is None:
            self.mean, self.dev, self.dev_sq = (torch.zeros_like(p) for p in parts)
        self.mean += parts[0]
        self.dev += parts[1]
        self.dev_sq += parts[2]
        self.total += float(weight.sum())
        self.sq += float(weight @ norm2)
        self.quad += float(weight @ norm2.square())


def _accumulate(toy: Toy, kinds, samples: int, gen: torch.Generator, weight_fn) -> tuple[dict, bool]:
    """{kind: Moments} over mu: every completion with its probability when V^L <= EXACT_MAX, else
    `samples` draws from mu. Returns (moments, exact)."""
    length, vocab = toy.old_logp.shape
    moments = {k: Moments() for k in kinds}
    exact = vocab**length <= EXACT_MAX
    if exact:
        chunks = [(torch.tensor(list(itertools.product(range(vocab), repeat=length))), None)]
    else:
        chunk = max(CHUNK_TOKENS // length, 1)
        chunks = [(None, min(chunk, samples - start)) for start in range(0, samples, chunk)]
    for tokens, n in chunks:
        if tokens is None:
            tokens = torch.multinomial(toy.mu_logp.exp(), n, replacement=True, generator=gen).T
        grads, rho = completion_gradients(toy, tokens, kinds, weight_fn)
        pos = torch.arange(length).expand_as(tokens)
        weight = toy.mu_logp[pos, tokens].sum(-1).exp() if exact else torch.ones(len(tokens), dtype=torch.float64)
        reference = rho[:, None] * grads["none"]
        for k in kinds:
            moments[k].add(weight, grads[k], grads[k] - reference, grads["none"])
    return moments, exact


def _kind_numbers(m: Moments, t2: float, batch: int, exact: bool) -> dict:
    """bias, variance, MSE (relative to ||target||, ||target||^2) and their Monte Carlo s.e."""
    mean = m.mean / m.total
    bias_vec = m.dev / m.total  # E_mu[g - rho g_none] = E_mu[g] - target
    variance = m.sq / m.total - float(mean.square().sum())
    if exact:
        se_bias_vec, se_var = torch.zeros_like(bias_vec), 0.0
    else:
        se_bias_vec = ((m.dev_sq / m.total - bias_vec.square()).clamp(min=0) / m.total).sqrt()
        se_var = math.sqrt(max(m.quad / m.total - (m.sq / m.total) ** 2, 0.0) / m.total)
    # ||mean of the draws||^2 over-states bias^2 by the draws' noise: subtract it
    bias2 = max(float(bias_vec.square().sum()) - float(se_bias_vec.square().sum()), 0.0)
    se_bias2 = 2 * float((bias_vec.square() * se_bias_vec.square()).sum().sqrt())
    return {
        "bias": math.sqrt(bias2 / t2),
        "bias_se": float(se_bias_vec.square().sum().sqrt()) / math.sqrt(t2),
        "variance": variance / t2,
        "variance_se": se_var / t2,
        "mse": (bias2 + variance / batch) / t2,
        "mse_se": math.hypot(se_bias2, se_var / batch) / t2,
        "exact": exact,
        "_bias2_se": se_bias2 / t2,
        "_mean2": float(mean.square().sum()) / t2,
    }


def _paired_with_none(out: dict, moments: dict, t2: float, batch: int, exact: bool) -> None:
    """Each kind's MSE against no correction's from the same completions: mse_vs_none =
    (MSE - MSE_none) / MSE_none and its Monte Carlo s.e. (the variance part paired; the bias
    parts' errors added: conservative)."""
    base = out["none"]
    for k, r in out.items():
        m = moments[k]
        paired, paired_sq = m.paired / m.total, m.paired_sq / m.total
        var_diff = paired / t2 - (r["_mean2"] - base["_mean2"])  # tr Cov_k - tr Cov_none, relative
        diff = r["bias"] ** 2 - base["bias"] ** 2 + var_diff / batch
        se_var = 0.0 if exact else math.sqrt(max(paired_sq - paired**2, 0.0) / m.total) / t2
        se = math.hypot(r["_bias2_se"] + base["_bias2_se"], se_var / batch)
        r["mse_vs_none"] = diff / base["mse"]
        r["mse_vs_none_se"] = se / base["mse"]
    for r in out.values():
        del r["_bias2_se"], r["_mean2"]


def measure(toy: Toy, kinds=KINDS, *, samples: int = 200_000, batch: int = 2048, seed: int = 0, weight_fn=None):
    """{kind: {bias, variance, mse, mse_vs_none, and their Monte Carlo standard errors (0 when
    exact)}}, relative to ||target|| (bias) or ||target||^2 (variance, mse). "none" is always measured."""
    kinds = tuple(dict.fromkeys(("none", *kinds)))
    gen = torch.Generator().manual_seed(seed)
    t2 = float(target_gradient(toy).square().sum())
    moments, exact = _accumulate(toy, kinds, samples, gen, weight_fn)
    out = {k: _kind_numbers(m, t2, batch, exact) for k, m in moments.items()}
    _paired_with_none(out, moments, t2, batch, exact)
    return out


def best_kind(results: dict) -> str:
    """The kind with the lowest MSE in one measurement ({kind: {mse: ...}})."""
    return min(results, key=lambda k: results[k]["mse"])


def recommendation(rows: list[dict]) -> tuple[str, dict]:
    """(the kind with the lowest MSE, {kind: its MSE against no correction's, mean over rows}) for
    rows of measure()'s output: relative to no correction's, so that each length and seed counts
    alike (a longer completion's MSE is larger for every kind)."""
    mean = {k: sum(r[k]["mse_vs_none"] for r in rows) / len(rows) for k in rows[0]}
    return min(mean, key=mean.get), mean


def recommendations(settings: dict) -> dict:
    """The constant losses.RECOMMENDED_CORRECTION reads, from run()'s settings: per setting the
    lowest MSE over every length and seed; at staleness also over the completions longer than
    losses.LONG_COMPLETION_TOKENS alone ("staleness_long"), because there the product's cap binds
    (the product of hundreds of ratios one update apart leaves [1/cap, cap]) and a length decides
    the kind. (A bf16 rollout's kinds stay within 2% of each other at every length: one kind.)"""
    from megatron_dppo.algorithms.losses import LONG_COMPLETION_TOKENS

    out = {}
    for setting, v in settings.items():
        cases = v["cases"]
        if setting == "staleness":
            short = [c["kinds"] for c in cases if c["length"] <= LONG_COMPLETION_TOKENS]
            long = [c["kinds"] for c in cases if c["length"] > LONG_COMPLETION_TOKENS]
            out[setting] = recommendation(short)[0] if short else v["recommended"]
            if long:
                out["staleness_long"] = recommendation(long)[0]
        else:
            out[setting] = v["recommended"]
    return out


def run(settings, lengths, seeds, samples, batch, weight_fn=None, log=None) -> dict:
    """Every (setting, length, seed): the toy's KL and ratio range and measure()'s numbers at N =
    batch (and the MSE at 256); then per setting the recommendation."""
    out = {"batch": batch, "bounds": default_bounds(), "settings": {}}
    for setting in settings:
        cases = []
        for length, seed in itertools.product(lengths, seeds):
            toy = make_toy(setting, length, seed)
            res = measure(toy, samples=samples, batch=batch, seed=seed, weight_fn=weight_fn)
            for r in res.values():
                r["mse_256"] = r["bias"] ** 2 + r["variance"] / 256
            cases.append({"length": length, "seed": seed, "kl": toy.kl, "rho_range": toy.rho_range(), "kinds": res})
            if log:
                log(f"{setting} L={length} seed {seed}: KL {toy.kl:.2e}, lowest MSE {best_kind(res)}")
        best, vs_none = recommendation([c["kinds"] for c in cases])
        wins = {k: sum(best_kind(c["kinds"]) == k for c in cases) for k in KINDS}
        out["settings"][setting] = {"cases": cases, "recommended": best, "mse_vs_none": vs_none, "wins": wins}
    return out


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, sd / math.sqrt(n)


def markdown(result: dict) -> str:
    """The table of docs/algorithm.md section 8: per setting and length, each kind's bias, variance
    and MSE (mean +- s.e. over seeds), its MSE against no correction's on the same completions, in
    how many seeds it had the lowest MSE, and the largest Monte Carlo s.e. of that comparison."""
    n = result["batch"]
    lines = [
        f"| setting | L | kind | bias | variance | MSE at N = {n} (x1e-3) | MSE vs none | lowest MSE in | "
        "MC s.e. of MSE vs none |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for setting, s in result["settings"].items():
        for length in sorted({c["length"] for c in s["cases"]}):
            cases = [c for c in s["cases"] if c["length"] == length]
            for k in KINDS:
                col = {
                    f: _mean_se([c["kinds"][k][f] for c in cases]) for f in ("bias", "variance", "mse", "mse_vs_none")
                }
                wins = sum(best_kind(c["kinds"]) == k for c in cases)
                mc = max(c["kinds"][k]["mse_vs_none_se"] for c in cases)
                mark = "**" if k == s["recommended"] else ""
                lines.append(
                    f"| {setting} | {length} | {mark}{k}{mark} | {col['bias'][0]:.4f} +- {col['bias'][1]:.4f} | "
                    f"{col['variance'][0]:.3g} +- {col['variance'][1]:.2g} | "
                    f"{1e3 * col['mse'][0]:.3f} +- {1e3 * col['mse'][1]:.3f} | "
                    f"{col['mse_vs_none'][0]:+.2%} +- {col['mse_vs_none'][1]:.2%} | {wins}/{len(cases)} | "
                    f"{'exact' if cases[0]['kinds'][k]['exact'] else f'{mc:.3%}'} |"
                )
    return "\n".join(lines)


def summary_lines(result: dict) -> list[str]:
    out = []
    for setting, s in result["settings"].items():
        kl = [c["kl"] for c in s["cases"]]
        lo = min(c["rho_range"][0] for c in s["cases"])
        hi = max(c["rho_range"][1] for c in s["cases"])
        mean = s["mse_vs_none"]
        ranked = sorted(mean, key=mean.get)
        out.append(
            f"{setting}: KL(mu || pi_old) {min(kl):.2e}..{max(kl):.2e} a token, rho in [{lo:.3f}, {hi:.3f}]; "
            f"lowest MSE: {ranked[0]} ({mean[ranked[0]]:+.2%} against no correction's, mean over lengths and seeds), "
            f"then {ranked[1]} ({mean[ranked[1]]:+.2%}); lowest in {s['wins'][ranked[0]]}/{len(s['cases'])} cases"
        )
    return out


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--",
                "megatron_dppo/algorithms/losses.py",
                "tools/rollout_correction_table.py",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--samples", type=int, default=200_000, help="Monte Carlo completions where V^L is too many")
    p.add_argument("--batch", type=int, default=2048, help="N: completions per step in the MSE")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--out", help="write the JSON here (docs/rollout_correction_table.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = run(
        args.settings,
        args.lengths,
        range(args.seeds),
        args.samples,
        args.batch,
        log=lambda s: print(s, file=sys.stderr),
    )
    result.update(commit=_commit(), seconds=round(time.perf_counter() - t0, 1), samples=args.samples, vocab=VOCAB)
    result["recommended"] = recommendations(result["settings"])
    print(markdown(result))
    print()
    for line in summary_lines(result):
        print(line)
    print(f"recommended: {result['recommended']} (commit {result['commit']}, {result['seconds']} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
