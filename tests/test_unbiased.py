"""Monte Carlo unbiasedness of the pruned-and-reweighted gradient (DPPO.md section 4)."""
import subprocess
import sys

import pytest

from megatron_dppo.algorithms import pruning
from megatron_dppo.algorithms.losses import LOSS_AGGS
from megatron_dppo.unbiased_check import CheckConfig, run_check


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("ratio_type,kl", [("token", 0.0), ("sequence", 0.0), ("token", 0.1)])
def test_dppo_is_unbiased(agg, ratio_type, kl):
    cfg = CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.5, r_o=0.7, ratio_type=ratio_type, kl_coef=kl,
                      draws=1500, seed=1)
    res = run_check(cfg)
    assert res.exact == (agg != "token-mean")
    assert res.unbiased, res.summary(cfg)
    assert res.rel_variance > 0  # pruning really happened
    if res.exact:
        assert res.max_z <= res.z_threshold


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_completion_pruning_alone_is_exact_for_token_mean(agg):
    res = run_check(CheckConfig(strategy="dppo", loss_agg=agg, r_q=0.0, r_o=0.5, draws=1500, seed=2))
    assert res.exact and res.unbiased


def test_cppo_and_greso_are_biased():
    cppo = run_check(CheckConfig(strategy="cppo", r_q=0.0, r_o=0.5, draws=200))
    assert not cppo.unbiased and cppo.rel_error > 0.05
    greso = run_check(CheckConfig(strategy="greso", r_q=0.9, r_o=0.0, draws=1500, seed=3, num_prompts=32))
    assert not greso.unbiased, greso.summary(CheckConfig(strategy="greso"))


def test_check_catches_a_missing_reweighting(monkeypatch):
    """The check must be able to fail: DPPO without the Horvitz-Thompson weights is biased."""

    class Unweighted(pruning.DPPO):
        def prune_completions(self, advantages, ratio, generator=None):
            keep, _ = super().prune_completions(advantages, ratio, generator)
            return keep, keep.float()

    monkeypatch.setitem(pruning.STRATEGIES, "dppo", Unweighted)
    res = run_check(CheckConfig(strategy="dppo", r_q=0.0, r_o=0.5, draws=1500))
    assert not res.unbiased


def test_cli_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "megatron_dppo.cli", "verify-unbiased", "--draws", "800"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "UNBIASED" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_dppo.cli", "verify-unbiased", "--strategy", "cppo",
                          "--draws", "50"], capture_output=True, text=True)
    assert bad.returncode == 1 and "BIASED" in bad.stdout
