"""verify-unbiased at trainer.max_staleness = K >= 2 and with partial rollouts (issue 46 item 3):
the rollout policy K updates older than pi_old; a completion whose tokens up to a switch point
came from version c - K and the rest from c - K + 1, each token with its own sampler's log-prob.
The untruncated product is exact in both, and every negative control (a wrong rho) exits 1."""

import math

import pytest
import torch

from megatron_dppo.jobs.verify_rollout import RolloutCheckConfig, run_rollout_check
from megatron_dppo.jobs.verify_unbiased import CheckConfig, run_correction_check


def _cli(capsys, *args):
    """megatron-dppo verify-unbiased in process: (exit code, stdout lines, stderr)."""
    from megatron_dppo.cli import main

    try:
        code = main(["verify-unbiased", *args])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


def _monte_carlo_line(lines):
    (line,) = [x for x in lines if x.startswith("dppo ")]
    return line


@pytest.mark.parametrize("staleness", [2, 4])
def test_the_cli_passes_the_untruncated_product_k_updates_behind(capsys, staleness):
    """Sampled by v1, pi_old = v(K+1): the product is exact in the table and in DPPO's Monte Carlo
    check (the z-test), and the lag the groups record is K by the trainer's rule."""
    args = ("--staleness", str(staleness), "--rollout-correction", "seq_tis", "--rollout-correction-cap", "inf")
    code, lines, err = _cli(capsys, *args, "--draws", "300")
    assert code == 0, (err, lines[-1])
    assert f"pi_old = v{staleness + 1}, sampled by v1, rho computed against v1" in lines[0]
    mc = _monte_carlo_line(lines)
    assert f"policy lag {staleness} by the trainer's rule" in mc and mc.endswith(": UNBIASED") and "exact" in mc
    assert lines[-1].startswith("no line counts against seq_tis: UNBIASED (exact)")
    assert f"recommended for staleness {staleness}: seq_tis" in lines[-1]


@pytest.mark.parametrize("control", ["inverted", "one", "stale"])
def test_the_cli_exits_1_on_each_negative_control_four_updates_behind(capsys, control):
    """A wrong rho at K = 4 fails the exact table (the untruncated rows beyond their bound of 0) and
    the Monte Carlo check (its z-test), exit 1."""
    args = ("--staleness", "4", "--rollout-correction", "seq_tis", "--rollout-correction-cap", "inf")
    code, lines, _ = _cli(capsys, *args, "--negative-control", control, "--draws", "300")
    assert code == 1 and lines[-1].startswith("bias detected: ") and "seq_tis no cap length 3" in lines[-1]
    assert "dppo seq-mean-token-mean + seq_tis: bias beyond the Monte Carlo noise" in lines[-1]
    assert _monte_carlo_line(lines).endswith(": BIASED")


def test_at_the_configs_cap_four_updates_behind_the_product_is_biased_within_its_bound(capsys):
    """Cap 2 binds K = 4 behind: seq_tis is BIASED (bounded), still less biased than none: exit 0."""
    code, lines, _ = _cli(capsys, "--staleness", "4", "--rollout-correction", "seq_tis", "--draws", "300")
    (row,) = [x for x in lines if "seq_tis      cap 2" in x]
    assert code == 0 and "BIASED (bounded: 0.317 <= 1.08)" in row and "no correction's bias 0.602" in row
    assert lines[-1].startswith("no line counts against seq_tis: BIASED (bounded")


def test_a_partial_rollout_samples_each_token_from_its_side_of_the_switch_point():
    """The last of 3 tokens is before the switch only when s = 3 (probability 1/3): its empirical
    distribution is 1/3 v1 + 2/3 v2; the first token always comes from v1. K = 4: v1, v2 differ."""
    from megatron_dppo.jobs.verify_unbiased import _correction_toy, _sample_rollout

    cfg = CheckConfig(staleness=4, partial=True)
    toy = _correction_toy(cfg)
    p = toy.policies
    assert (p.sampled, p.newer, p.current) == (1, 2, 5)
    gen = torch.Generator().manual_seed(0)
    batches = [_sample_rollout(toy, cfg, gen) for _ in range(150)]
    tokens = torch.cat([t.view(-1, 3) for t, _, _ in batches])
    before = torch.cat([b.view(-1, 3) for _, _, b in batches])
    assert before[:, 0].all() and 0.3 < before[:, 2].float().mean() < 0.37
    n = len(tokens)
    for position, expected in (
        (0, p.sample_logp.exp()),
        (2, (p.sample_logp.exp() + 2 * p.sample_logp_after.exp()) / 3),
    ):
        freq = torch.bincount(tokens[:, position], minlength=6).double() / n
        se = (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() < 5 * se).all(), (position, freq, expected)
    # the rollout log-prob of each token is its own sampler's
    t, _, b = batches[0]
    sample, rollout = p.token_logps(t, b)
    assert torch.equal(sample, rollout) and torch.equal(rollout[~b], p.sample_logp_after[t[~b]])


@pytest.mark.parametrize("staleness", [1, 2])
def test_partial_rollouts_keep_the_product_exact_and_one_policy_records_are_biased(staleness):
    """The exact table averages over the switch points: the untruncated product of per-token
    ratios is exact; recording every token as the newer version's is biased beyond its bound."""
    base = dict(length=3, staleness=staleness, partial=True, cap=math.inf)
    assert run_rollout_check(RolloutCheckConfig(**base), "seq_tis").unbiased
    assert run_rollout_check(RolloutCheckConfig(**base), "none").rel_bias > 0.05
    wrong = run_rollout_check(RolloutCheckConfig(**base, control="partial-one-policy"), "seq_tis")
    assert not wrong.within_bound and wrong.rel_bias > 0.05


def test_the_partial_rollout_monte_carlo_check_passes_and_its_negative_control_fails(capsys):
    """DPPO's Monte Carlo check on partial rollouts two updates behind: exact and UNBIASED; with the
    partial-one-policy control BIASED and exit 1 through the CLI."""
    base = dict(staleness=2, partial=True, rollout_correction="seq_tis", advantage="drgrpo", draws=400)
    ok = run_correction_check(CheckConfig(**base, rollout_correction_cap=math.inf))
    assert ok.exact and ok.unbiased and ok.max_lag == 2 and (ok.sampled_version, ok.newer_version) == (1, 2)
    args = ("--staleness", "2", "--partial", "--rollout-correction", "seq_tis")
    code, lines, _ = _cli(capsys, *args, "--draws", "400")
    assert code == 0 and "partial rollouts: each completion sampled by v1 up to its switch point and by v2" in lines[0]
    assert _monte_carlo_line(lines).endswith(": UNBIASED")
    # 1000 draws: the control's Monte Carlo bias (0.12 +- 0.03) resolved beyond the z limit
    code, lines, _ = _cli(capsys, *args, "--negative-control", "partial-one-policy", "--draws", "1000")
    assert code == 1 and "rho computed against v2 for every token" in lines[0]
    assert _monte_carlo_line(lines).endswith(": BIASED") and lines[-1].startswith("bias detected: ")


def test_the_cli_refuses_a_staleness_or_partial_setting_it_cannot_build(capsys):
    code, lines, err = _cli(capsys, "--staleness", "-1")
    assert code == 2 and not lines and "argument --staleness: expected an integer >= 0, got -1" in err
    code, lines, err = _cli(capsys, "--partial", "--rollout-correction", "seq_tis")
    assert code == 2 and not lines and err.startswith("verify-unbiased: --partial needs --staleness >= 1")
    code, lines, err = _cli(capsys, "--staleness", "1", "--negative-control", "partial-one-policy")
    assert code == 2 and not lines and err.startswith("verify-unbiased: --negative-control partial-one-policy needs")
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        run_correction_check(CheckConfig(staleness=-1, rollout_correction="seq_tis"))
