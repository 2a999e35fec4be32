"""Monte Carlo unbiasedness of the pruned-and-reweighted gradient (docs/dppo.md section 4)."""

import pytest

from megatron_dppo.algorithms import pruning
from megatron_dppo.algorithms.losses import LOSS_AGGS
from megatron_dppo.jobs.verify_unbiased import CheckConfig, bias_estimate, run_check, run_dynamic_check

# Thousands of draws per check: minutes of CPU in all, left out of `make test-fast` (CI runs them).
pytestmark = pytest.mark.slow

# An exact estimator is judged by the z-test, whose limit (4.0) is in units of the draws' s.e.: 500
# draws see a missing completion weight (pruning.DPPO's w_o replaced by 1) in every exact setting
# below at max|z| 27-85 (6.8-21 times the limit; measured), so more draws add time, not power.
EXACT_DRAWS = 500


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("ratio_type,kl", [("token", 0.0), ("sequence", 0.0), ("token", 0.1)])
def test_dppo_is_unbiased(agg, ratio_type, kl):
    # token-mean with r_q > 0 is judged on its bias (5%): draws enough for an s.e. below 2.5%; the
    # others are exact (EXACT_DRAWS)
    cfg = CheckConfig(
        strategy="dppo",
        loss_agg=agg,
        r_q=0.5,
        r_o=0.7,
        ratio_type=ratio_type,
        kl_coef=kl,
        draws=2500 if agg == "token-mean" else EXACT_DRAWS,
        seed=1,
    )
    res = run_check(cfg)
    assert res.exact == (agg != "token-mean")
    assert res.unbiased, res.summary(cfg)
    assert res.rel_variance > 0  # pruning really happened
    if res.exact:
        assert res.max_z <= res.z_threshold


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_completion_pruning_alone_is_exact_for_token_mean(agg):
    res = run_check(CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.0, r_o=0.5, draws=EXACT_DRAWS, seed=2))
    assert res.exact and res.unbiased


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_dppo_with_the_overlong_filter_is_unbiased_for_the_filtered_objective(agg):
    """DAPO's filter (truncated completions get no loss) is a fixed function of the full batch:
    DPPO stays unbiased for the filtered full-batch loss (exact where it is without the filter)."""
    draws = 3500 if agg == "token-mean" else EXACT_DRAWS  # token-mean is judged on its bias: an s.e. below 2.5%
    cfg = CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.5, r_o=0.5, overlong_filter=True, draws=draws, seed=6)
    res = run_check(cfg)
    assert res.unbiased, res.summary(cfg)
    assert res.exact == (agg != "token-mean") and "overlong filter" in res.summary(cfg)


@pytest.mark.parametrize("strategy", ["cppo", "cppo-group"])
def test_cppo_is_biased(strategy):
    res = run_check(CheckConfig(strategy=strategy, r_q=0.0, r_o=0.5, draws=200))
    assert not res.unbiased and res.rel_error > 0.05


@pytest.mark.parametrize("strategy", ["greso", "greso-simple"])
def test_greso_is_biased(strategy):
    # 300 draws: max|z| ~150 (greso) and ~260 (greso-simple) against the limit 4.0 (measured: 195 and 341 at 500)
    cfg = CheckConfig(strategy=strategy, r_q=0.9, r_o=0.0, draws=300, seed=3, num_prompts=32)
    res = run_check(cfg)
    assert not res.unbiased, res.summary(cfg)


def test_check_catches_a_missing_reweighting(monkeypatch):
    """The check must be able to fail: DPPO without the Horvitz-Thompson weights is biased."""

    class Unweighted(pruning.DPPO):
        def prune_completions(self, advantages, ratio, generator=None):
            keep, _ = super().prune_completions(advantages, ratio, generator)
            return keep, keep.float()

    monkeypatch.setitem(pruning.STRATEGIES, "dppo", Unweighted)
    res = run_check(CheckConfig(strategy="dppo", r_q=0.0, r_o=0.5, draws=EXACT_DRAWS))  # max|z| 66 > 4.0
    assert not res.unbiased


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_removing_the_prompt_weight_is_caught(agg):
    """The negative control of prompt pruning, per aggregation: DPPO's kept prompts trained with
    w_q = 1 must be BIASED. The setting gives the check power: at seed 3 (r_q = 0.5, r_o = 0, so
    only the prompt draws are random) some candidate prompts carry gradient, and 600 draws put the
    missing weight's bias at 15-16% of the gradient against an s.e. of 0.7% (max|z| 50-90 against
    the limit 4.0; measured): with a normal approximation the power is 1 - Phi(4 - 50) ~ 1. At
    seed 1 the check has none for the per-sequence aggregations: its candidates are all
    zero-variance groups, whose zero gradient w_q only rescales (rel.err 0.0000 +- 0.0000)."""
    cfg = CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.5, r_o=0.0, draws=600, seed=3, without_prompt_weight=True)
    res = run_check(cfg)
    assert not res.unbiased, res.summary(cfg)
    if res.exact:  # decided by the z-test: by a wide margin
        assert res.max_z > 5 * res.z_threshold, res.summary(cfg)
    else:  # decided by the bias test: a resolved bias over the 5% tolerance
        assert bias_estimate(res.rel_error, res.rel_std_error) > 2 * cfg.approx_tol, res.summary(cfg)
        assert res.rel_std_error <= cfg.approx_tol / 2
    assert "WITHOUT w_q (negative control)" in res.summary(cfg) and "BIASED" in res.summary(cfg)
    # The same setting with the weight is unbiased: the control isolates w_q.
    assert run_check(CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.5, r_o=0.0, draws=600, seed=3)).unbiased


def test_a_consistent_verdict_names_the_test_that_decided_and_the_bias():
    """A ratio estimator's line says that the bias test decided, the bias's size and sign, and
    whether the draws resolved it (max|z| against the limit), instead of a broken z-limit beside
    UNBIASED."""
    from megatron_dppo.jobs.verify_unbiased import CheckResult, verdict_text

    res = CheckResult(0.0195, 0.0047, 4.18, 4.0, 0.1, 0.2, 0.5, 0.9, True, False, True, bias_along=-0.018)
    line = verdict_text(res, 0.05, judged_by_z=False)
    assert line.startswith("consistent, decided by the bias test: bias 1.89% (along the target -1.80%; ")
    assert "resolved by the draws: max|z| 4.18 > limit 4.00" in line and line.endswith("UNBIASED")
    assert "not resolved" in verdict_text(
        CheckResult(0.02, 0.01, 2.0, 4.0, 0, 0, 0, 0, True, False, True), 0.05, judged_by_z=False
    )
    exact = CheckResult(0.01, 0.01, 4.18, 4.0, 0, 0, 0, 0, True, True, False)
    assert (
        verdict_text(exact, 0.05, judged_by_z=True) == "exact, decided by the z-test: max|z| 4.18 > limit 4.00: BIASED"
    )


# ---- DAPO dynamic sampling + DPPO: the refill rule (docs/algorithm.md) ---------------------------


def test_dapo_dppo_refill_by_weight_keeps_the_unpruned_dapo_gradient():
    """Averaged over the stream's order (the sampler shuffles), the mean gradient equals unpruned
    DAPO's within 5% and the trained weight is exactly B at every draw."""
    cfg = CheckConfig(strategy="dppo", num_prompts=8, r_q=0.5, r_o=0.5, draws=2500, seed=0)
    res = run_dynamic_check(cfg)
    assert res.unbiased, res.summary(cfg)
    assert res.rel_std_error <= 0.025  # enough draws to see a 5% bias
    assert res.mean_total_weight == pytest.approx(8.0, abs=1e-9) and res.shortfall_frac == 0
    assert res.rolled_out < res.rolled_out_unpruned  # prompt pruning saved rollouts


def test_dapo_refill_by_count_double_counts_and_is_caught():
    """The old rule (refill to B groups by count, each with its full w_q) is caught: its mean total
    weight is 8.44, not B = 8 (measured at 600 draws and at 2500: the weight's noise is small; the
    gradient's 5% bias is at the tolerance, barely resolved even by 2500 draws, so the weight decides)."""
    cfg = CheckConfig(strategy="dppo", num_prompts=8, r_q=0.5, r_o=0.5, draws=600, seed=0, refill_by="count")
    res = run_dynamic_check(cfg)
    assert not res.unbiased, res.summary(cfg)
    assert res.mean_total_weight > 1.03 * 8


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_dapo_with_completion_pruning_alone_is_exact(agg):
    """r_q = 0: the trained groups are unpruned DAPO's, whatever the stream order; exact."""
    cfg = CheckConfig(
        strategy="dppo", num_prompts=8, r_q=0.0, r_o=0.7, loss_agg=agg, draws=EXACT_DRAWS, seed=4, fixed_order=True
    )
    res = run_dynamic_check(cfg)
    assert res.exact and res.unbiased, res.summary(cfg)
    assert res.rel_variance > 0


def test_dapo_check_refuses_what_it_cannot_check():
    with pytest.raises(ValueError, match="'greso' replaces skipped prompts"):
        run_dynamic_check(CheckConfig(strategy="greso", draws=1))
    with pytest.raises(ValueError, match="needs kl_coef = 0"):
        run_dynamic_check(CheckConfig(kl_coef=0.1, draws=1))
    with pytest.raises(ValueError, match="refill_by must be one of"):
        run_dynamic_check(CheckConfig(refill_by="guess", draws=1))


def test_bppo_ratio_bias_decomposition_matches_the_full_gradient():
    """bppo_prompt_pruning_bias's per-prompt decomposition sum n / sum d is the unpruned BPPO
    gradient computed by the method check; with nothing pruned (r_q = 0) there is no bias at all;
    at r_q = 0.5 (seed 0, B = 16, seq-mean-token-mean) the ratio's bias is resolved (over 3 s.e.)"""
    import torch

    from megatron_dppo.jobs import verify_methods as um

    for agg in LOSS_AGGS:
        cfg = CheckConfig(method="bppo", r_o=0.0, r_q=0.5, loss_agg=agg, seed=0)
        gen = torch.Generator().manual_seed(cfg.seed)
        bppo = um.SYNTHETIC["bppo"]
        rewards, _, lengths, J, _, seq_index, seq_len, sums, aux, _ = um._setting(cfg, bppo, gen)
        method = um._method(cfg, pruning.get_strategy("dppo"), dynamic_sampling=False)
        full = um._full_gradient(cfg, bppo, method, rewards, lengths, sums, J, aux, seq_index, seq_len)
        res = um.bppo_prompt_pruning_bias(cfg, draws=20000 if agg == "seq-mean-token-mean" else 100)
        torch.testing.assert_close(res["full"], full, rtol=1e-10, atol=1e-12)
        if agg == "seq-mean-token-mean":  # 2.4% +- 0.2%
            assert res["rel_bias"] > 3 * res["rel_se"], (agg, res)
        none = um.bppo_prompt_pruning_bias(CheckConfig(method="bppo", r_o=0.0, r_q=0.0, loss_agg=agg), draws=100)
        assert none["rel_bias"] < 1e-12 and none["rel_se"] < 1e-12
