"""tools/rollout_correction_table.py: the measurement behind verify_rollout.RECOMMENDED_CORRECTION.
Its exact target against an enumeration, its Monte Carlo path against its exact one, a tiny run's
verdict, a deliberately wrong weight changing that verdict, and the recorded JSON's
recommendation being the constant the start-up warning and README read."""

import itertools
import json

import pytest
import torch
from shared_helpers import REPO, load_tool

from megatron_dppo.algorithms import losses
from megatron_dppo.jobs.verify_rollout import RECOMMENDED_CORRECTION

table = load_tool("rollout_correction_table")


@pytest.mark.parametrize("setting", table.SETTINGS)
def test_the_exact_target_is_the_on_policy_mean_of_the_librarys_gradient(setting):
    """The dynamic programme's target = sum over all 6^4 completions of pi_old(o) g_none(o)."""
    toy = table.make_toy(setting, 4, seed=3)
    tokens = torch.tensor(list(itertools.product(range(table.VOCAB), repeat=4)))
    grads, _ = table.completion_gradients(toy, tokens, ["none"])
    p_old = toy.old_logp[torch.arange(4), tokens].sum(-1).exp()
    assert torch.allclose(p_old @ grads["none"], table.target_gradient(toy), rtol=1e-10, atol=1e-14)


def test_the_settings_have_the_measured_gaps():
    stale, bf16 = table.make_toy("staleness", 16, seed=0), table.make_toy("bf16", 16, seed=0)
    assert stale.kl == pytest.approx(table.STALE_KL, rel=1e-6)
    lo, hi = bf16.rho_range()
    assert hi / lo == pytest.approx(table.BF16_RHO[1] / table.BF16_RHO[0], rel=0.02)
    assert 1e-5 < bf16.kl < 1e-3  # docs/gpus.md's measured 9.1e-5 is this order


def test_the_monte_carlo_path_agrees_with_the_exact_one(monkeypatch):
    """L = 5 (7776 completions) measured exactly and by 200k draws: each kind's numbers within a few
    of their stated standard errors (plus float noise)."""
    toy = table.make_toy("staleness", 5, seed=1)
    monkeypatch.setattr(table, "EXACT_MAX", 10**4)
    exact = table.measure(toy)
    monkeypatch.setattr(table, "EXACT_MAX", 10)
    mc = table.measure(toy, samples=200_000, seed=1)
    for k in losses.ROLLOUT_CORRECTIONS:
        assert not mc[k]["exact"] and exact[k]["exact"]
        for f in ("bias", "variance", "mse"):
            assert abs(mc[k][f] - exact[k][f]) <= 5 * mc[k][f + "_se"] + 1e-3 * exact[k][f] + 1e-6, (k, f)
    assert mc["seq_tis"]["bias"] == 0.0  # the untruncated ratio: its draws equal the reference's, exactly


def test_a_tiny_run_has_a_verdict_and_a_wrong_weight_changes_it():
    """One seed at L = 4 (exact) in seconds: at staleness the lowest MSE is seq_tis's. Fed a weight
    that inverts rho (mu / pi_old) the same run ranks seq_tis below no correction: the tool's verdict
    can fail."""
    right = table.run(["staleness"], [4], [0], samples=1000, batch=2048)
    assert right["settings"]["staleness"]["recommended"] == "seq_tis"
    (case,) = right["settings"]["staleness"]["cases"]
    assert table.best_kind(case["kinds"]) == "seq_tis" and case["kinds"]["seq_tis"]["mse_vs_none"] < 0

    def inverted(old_logp, rollout_logp, *args, **kw):
        return losses.rollout_correction(rollout_logp, old_logp, *args, **kw)

    wrong = table.run(["staleness"], [4], [0], samples=1000, batch=2048, weight_fn=inverted)
    (case,) = wrong["settings"]["staleness"]["cases"]
    assert wrong["settings"]["staleness"]["recommended"] != "seq_tis"
    assert case["kinds"]["seq_tis"]["mse_vs_none"] > 0 and case["kinds"]["seq_tis"]["bias"] > 0.05


def test_the_recorded_table_is_what_the_recommendation_reads():
    """docs/rollout_correction_table.json (the run docs/algorithm.md section 8 quotes) recommends
    verify_rollout.RECOMMENDED_CORRECTION, over >= 8 seeds and >= 2 lengths with the config's bounds."""
    with open(REPO / "docs" / "rollout_correction_table.json") as f:
        recorded = json.load(f)
    assert recorded["recommended"] == RECOMMENDED_CORRECTION
    assert recorded["bounds"] == table.default_bounds()
    for setting in table.SETTINGS:
        cases = recorded["settings"][setting]["cases"]
        assert len({c["seed"] for c in cases}) >= 8 and len({c["length"] for c in cases}) >= 2
    assert table.recommendations(recorded["settings"]) == RECOMMENDED_CORRECTION
    # the bands differ at staleness (the product's cap binds at 256 tokens), so a length rule is needed
    assert RECOMMENDED_CORRECTION["staleness"] != RECOMMENDED_CORRECTION["staleness_long"]
    cases = recorded["settings"]["staleness"]["cases"]
    best, _ = table.recommendation([c["kinds"] for c in cases])
    assert best == "seq_tis"  # over every length: the short completions' kind
