"""algorithm.rollout_correction (issue 31): the weights of each kind against a per-token reference
written out here, the mismatch metrics against plain formulas, the weights folded into the
micro-batch loss, the exact verify check (untruncated IS unbiased, none biased) and DPPO's
Monte Carlo check with the correction on, the config's rules and the first-step warning."""

import math

import pytest
import torch
from loss_batches import three_sequence_batch

from megatron_dppo.algorithms import losses
from megatron_dppo.config import AlgorithmConfig, load_config
from megatron_dppo.jobs.verify_rollout import RolloutCheckConfig, run_rollout_check
from megatron_dppo.jobs.verify_unbiased import CheckConfig
from megatron_dppo.train.metrics import rollout_gap_warning, train_metrics
from megatron_dppo.train.preflight import config_warnings

CAP, LOW, HIGH = 1.5, 0.8, 1.25
# the geometric-mean masks' own bounds, chosen so that they mask another sequence than [LOW, HIGH]
# would (geometric means 1.133, 0.797, 1.053): a geometric mask reading the token bounds fails
SEQ_LOW, SEQ_HIGH = 0.75, 1.1


def _rho_batch():
    """Three sequences of 4, 3 and 5 tokens with ratios on both sides of every bound."""
    log_rho = torch.tensor(
        [0.0, 0.1, 0.5, -0.1] + [-0.4, -0.3, 0.02] + [0.05, 0.05, 0.05, 0.05, 0.06], dtype=torch.float64
    )
    seq_index = torch.tensor([0] * 4 + [1] * 3 + [2] * 5)
    rollout = -torch.rand(len(log_rho), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return rollout + log_rho, rollout, seq_index, log_rho


def _reference_weights(kind, log_rho, seq_index):
    """Token by token, with plain Python: the docstring's table of losses.rollout_correction."""
    rho = [math.exp(x) for x in log_rho.tolist()]
    seqs = seq_index.tolist()
    seq_sum = {s: sum(x for x, t in zip(log_rho.tolist(), seqs) if t == s) for s in set(seqs)}
    seq_len = {s: seqs.count(s) for s in set(seqs)}
    out = []
    for r, s in zip(rho, seqs):
        w = 1.0
        if kind in ("tis", "tis_mask", "tis_seq_mask"):
            w = min(r, CAP)
        if kind == "seq_tis":
            w = min(math.exp(seq_sum[s]), CAP)
        if kind in ("mask", "tis_mask") and not LOW <= r <= HIGH:
            w = 0.0
        if kind in ("seq_mask", "tis_seq_mask") and not SEQ_LOW <= math.exp(seq_sum[s] / seq_len[s]) <= SEQ_HIGH:
            w = 0.0
        out.append(w)
    return out


@pytest.mark.parametrize("kind", losses.ROLLOUT_CORRECTIONS)
def test_each_kind_weighs_tokens_as_its_formula(kind):
    old, rollout, seq_index, log_rho = _rho_batch()
    weight, stats = losses.rollout_correction(
        old, rollout, seq_index, 3, kind, cap=CAP, low=LOW, high=HIGH, seq_low=SEQ_LOW, seq_high=SEQ_HIGH
    )
    want = _reference_weights(kind, log_rho, seq_index)
    assert weight.tolist() == pytest.approx(want, rel=1e-12)
    assert stats["masked"].tolist() == [w == 0 for w in want]
    per_seq = [[w for w, s in zip(want, seq_index.tolist()) if s == k] for k in range(3)]
    assert float(stats["masked_seqs"]) == sum(all(w == 0 for w in ws) for ws in per_seq)


def test_the_kinds_differ_on_this_batch():
    """The batch above separates every kind (so each parametrised case above can fail on another's rule)."""
    _, _, seq_index, log_rho = _rho_batch()
    rows = {tuple(_reference_weights(k, log_rho, seq_index)) for k in losses.ROLLOUT_CORRECTIONS}
    assert len(rows) == len(losses.ROLLOUT_CORRECTIONS)


def test_mismatch_metrics_are_the_estimators():
    old, rollout, seq_index, log_rho = _rho_batch()
    m = losses.rollout_mismatch(old, rollout, seq_index, 4)  # sequence 3 has no tokens: not counted
    rho = log_rho.exp()
    assert float(m["rollout_ratio_sum"]) == pytest.approx(float(rho.sum()))
    assert float(m["rollout_ratio_max"]) == pytest.approx(math.exp(0.5))
    assert float(m["rollout_ratio_min"]) == pytest.approx(math.exp(-0.4))
    assert float(m["rollout_kl_k1_sum"]) == pytest.approx(float((rollout - old).sum()))
    assert float(m["rollout_kl_k3_sum"]) == pytest.approx(sum(math.exp(x) - 1 - x for x in log_rho.tolist()))
    assert float(m["rollout_chi2_sum"]) == pytest.approx(sum(math.exp(2 * x) - 1 for x in log_rho.tolist()))
    seq_sums = [float(log_rho[seq_index == s].sum()) for s in range(3)]
    assert float(m["rollout_chi2_seq_sum"]) == pytest.approx(sum(math.exp(2 * x) - 1 for x in seq_sums))
    assert float(m["rollout_seqs"]) == 3


VOCAB, PADDED = 50, 64


def _logits(batch):
    """Logits over a padded vocabulary (the padding columns are masked by the log-prob code)."""
    return 3 * torch.randn(*batch.labels.shape, PADDED, generator=torch.Generator().manual_seed(6))


def test_micro_batch_loss_weighs_each_token_by_the_correction(tp1):
    """megatron/loss.py: the tis loss is sum_t coef_t * min(rho_t, cap) * l_t with rho from the batch's
    old and rollout log-probs, its gradient that of the reference; the report's shares and ratios
    are those of the same tokens; none leaves the loss as it was."""
    from megatron_dppo.megatron import loss as loss_mod

    batch = three_sequence_batch()
    logits = _logits(batch)
    index = loss_mod.loss_positions(batch.loss_mask)
    old, rollout = batch.old_logp.flatten()[index], batch.rollout_logp.flatten()[index]
    seq_index = batch.seq_index.flatten()[index]

    def run(kind):
        x = logits.clone().requires_grad_()
        algorithm = AlgorithmConfig(rollout_correction=kind, rollout_correction_cap=1.2)
        loss, _, report = loss_mod.micro_batch_loss(
            batch, x, algorithm=algorithm, vocab_size=VOCAB, temperature=0.9, mode="train", denominator=40.0
        )
        loss.backward()
        return loss, x.grad, report

    plain, plain_grad, _ = run("none")
    # The reference: the plain loss's per-token terms, each weighted by min(rho, cap) written out.
    x = logits.clone().requires_grad_()
    lp = torch.log_softmax(x[..., :VOCAB].float() / 0.9, -1).flatten(0, 1)
    lp = lp.gather(1, batch.labels.flatten()[:, None])[:, 0][index]
    ratio = torch.exp(lp - old)
    adv = batch.advantages.flatten()[index]
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    coef = batch.seq_weight[seq_index].double() / 40.0  # token-mean
    rho = torch.exp(old - rollout).double()
    want = (surrogate * (coef * rho.clamp(max=1.2)).float()).sum()
    want.backward()
    got, got_grad, report = run("tis")
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert torch.allclose(got_grad, x.grad, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(got_grad, plain_grad, rtol=1e-3)  # the weights did something
    assert float(report["rollout_truncated"]) == int((rho > 1.2).sum()) > 0
    assert float(report["rollout_ratio_neg_min"]) == pytest.approx(-float(rho.min()))
    assert float(plain) == pytest.approx(float((surrogate.detach() * coef.float()).sum()), rel=1e-5)


def test_a_correction_without_rollout_logprobs_is_refused(tp1):
    from megatron_dppo.megatron import loss as loss_mod

    batch = three_sequence_batch()
    batch.rollout_logp = None
    with pytest.raises(ValueError, match="algorithm.rollout_correction=tis needs the rollout engine's log-probs"):
        loss_mod.micro_batch_loss(
            batch,
            _logits(batch),
            algorithm=AlgorithmConfig(rollout_correction="tis"),
            vocab_size=VOCAB,
            temperature=1.0,
            mode="train",
            denominator=10.0,
        )


def test_untruncated_is_is_exactly_unbiased_and_no_correction_is_biased():
    """verify_rollout's exact sums: token IS at length 1 and the product at length 3 give the
    target policy's gradient to rounding; none (the negative control) and a cap do not."""
    assert run_rollout_check(RolloutCheckConfig(length=1, cap=math.inf), "tis").unbiased
    assert run_rollout_check(RolloutCheckConfig(length=3, cap=math.inf), "seq_tis").unbiased
    none = run_rollout_check(RolloutCheckConfig(length=3), "none")
    assert not none.unbiased and none.rel_bias > 0.1
    capped = run_rollout_check(RolloutCheckConfig(length=1, cap=1.2), "tis")
    assert not capped.unbiased and 1e-6 < capped.rel_bias < none.rel_bias
    assert not run_rollout_check(RolloutCheckConfig(length=3, cap=math.inf), "tis").unbiased  # per-token ratios only
    # Without a mismatch there is nothing to correct: none is then unbiased (the check is not stuck on BIASED).
    assert run_rollout_check(RolloutCheckConfig(length=2, mismatch=0.0), "none").unbiased


@pytest.mark.parametrize("staleness", [0, 1])
def test_every_kind_gets_a_verdict_within_its_bound(staleness):
    """verify-unbiased --rollout-correction's exact table: every kind a verdict, UNBIASED or BIASED
    within its bound (what the cap cuts, the mask removes, the token weight misses of the completion's
    ratio), the bound computed from the weights; the recommended kind less biased than none."""
    from megatron_dppo.jobs.verify_rollout import recommended_correction, run_rollout_checks

    rows = run_rollout_checks(RolloutCheckConfig(length=3, staleness=staleness))
    by_kind = {r.result.kind: r for r in rows[2:]}
    assert list(by_kind) == list(losses.ROLLOUT_CORRECTIONS)
    assert all(r.result.unbiased for r in rows[:2])  # the untruncated estimators theory says are exact
    for row in rows:
        r = row.result
        assert r.verdict == "UNBIASED (exact)" or r.verdict.startswith("BIASED (bounded: "), row.line()
        assert r.rel_bias <= r.bound + 1e-9 and not row.failure, row.line()
    rec = by_kind[recommended_correction(staleness)]
    assert rec.role == "recommended" and rec.result.rel_bias < by_kind["none"].result.rel_bias
    assert by_kind["mask"].result.bound > 0 and by_kind["seq_mask"].result.rel_bias > 0.5  # each measured


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("control", ["inverted", "one", "stale"])
def test_each_negative_control_fails_the_exact_check(control, staleness):
    """Wrong inputs (rho = mu / pi_old; rho = 1; samples from the weights one version older than
    the ones rho divides by) push a bias beyond its bound: the untruncated ratio's rows, and the
    recommended kind's at staleness 1 (seq_tis)."""
    from megatron_dppo.jobs.verify_rollout import run_rollout_checks

    rows = run_rollout_checks(RolloutCheckConfig(length=3, staleness=staleness, control=control))
    failed = {row.label for row in rows if row.failure}
    assert {"tis no cap length 1", "seq_tis no cap length 3"} <= failed, failed
    if staleness:
        assert "seq_tis cap 2 length 3" in failed
    assert all("beyond its bound" in row.failure for row in rows if row.failure and "recommended" not in row.role)


def test_the_staleness_path_records_which_version_sampled():
    """Versions v0..v2 (an exact update each): pi_old = v2; at staleness 1 the group was sampled by
    v1 and rho divides by v1; the stale control samples with v0 while rho still divides by v1."""
    normal = run_rollout_check(RolloutCheckConfig(length=3, staleness=1), "seq_tis")
    assert (normal.current_version, normal.sampled_version, normal.claimed_version) == (2, 1, 1)
    stale = run_rollout_check(RolloutCheckConfig(length=3, staleness=1, control="stale"), "seq_tis")
    assert (stale.current_version, stale.sampled_version, stale.claimed_version) == (2, 0, 1)
    assert not stale.within_bound and stale.rel_bias > 0.05


def test_token_is_one_update_behind_counts_against_the_run():
    """Token tis on 3-token completions one update behind is MORE biased than no correction on the
    toy (the issue's 22.9% against 16.4%): as the checked kind that counts; seq_tis does not."""
    from megatron_dppo.jobs.verify_rollout import run_rollout_checks

    cfg = RolloutCheckConfig(length=3, staleness=1)
    (tis,) = [r for r in run_rollout_checks(cfg, checked="tis") if r.role == "checked"]
    assert "more biased than no correction" in tis.failure and tis.result.within_bound
    (seq,) = [r for r in run_rollout_checks(cfg, checked="seq_tis") if "checked" in r.role]
    assert seq.result.unbiased and not seq.failure


def test_dppo_with_the_correction_is_judged_against_the_on_policy_gradient():
    """DPPO's Monte Carlo check with the correction: completions sampled by the rollout policy
    (staleness 1: the weights one version back), pruned and weighted as the trainer does, against
    the mean of full-batch gradients of batches sampled by pi_old itself, without a weight. seq_tis
    passes (exact: the z-test); each negative control is caught; tis is biased within its bound."""
    from megatron_dppo.jobs.verify_unbiased import run_correction_check

    base = dict(staleness=1, draws=700, advantage="drgrpo")
    ok = run_correction_check(CheckConfig(rollout_correction="seq_tis", **base))
    assert ok.exact and ok.unbiased and not ok.error and ok.max_lag == 1
    assert (ok.sampled_version, ok.claimed_version, ok.current_version) == (1, 1, 2)
    for control in ("inverted", "one", "stale"):
        bad = run_correction_check(CheckConfig(rollout_correction="seq_tis", negative_control=control, **base))
        assert not bad.unbiased and bad.error, (control, bad)
    tis = run_correction_check(CheckConfig(rollout_correction="tis", **base))
    assert tis.max_z > tis.z_threshold and tis.unbiased and 0 < tis.bound


def _cli(capsys, *args):
    """megatron-dppo verify-unbiased in process: (exit code, stdout lines, stderr)."""
    from megatron_dppo.cli import main

    code = main(["verify-unbiased", *args])
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


@pytest.mark.parametrize("control", ["inverted", "one", "stale"])
def test_the_cli_exits_1_on_each_negative_control_of_the_recommended_kind(capsys, control):
    args = ("--staleness", "1", "--rollout-correction", "seq_tis", "--negative-control", control, "--draws", "700")
    code, lines, _ = _cli(capsys, *args)
    assert code == 1 and lines[-1].startswith("bias detected: ") and "seq_tis cap 2 length 3" in lines[-1]
    assert f"NEGATIVE CONTROL {control}" in lines[0]


def test_the_cli_exits_1_on_token_tis_one_update_behind(capsys):
    """The issue's case: it printed a BIASED line and then "all unbiased", exit 0."""
    code, lines, _ = _cli(capsys, "--staleness", "1", "--rollout-correction", "tis", "--draws", "200")
    assert code == 1 and "tis (checked): more biased than no correction" in lines[-1]
    assert "recommended for staleness 1: seq_tis" in lines[-1] and "all unbiased" not in "\n".join(lines)


def test_the_cli_passes_the_recommended_kind_and_never_says_all_unbiased_after_a_biased_line(capsys):
    code, lines, _ = _cli(capsys, "--staleness", "1", "--rollout-correction", "seq_tis", "--draws", "300")
    assert code == 0 and lines[-1].startswith("no line counts against seq_tis: UNBIASED (exact)")
    assert any("BIASED (bounded" in line for line in lines) and "all unbiased" not in lines[-1]
    assert "sampled by v1, rho computed against v1" in lines[0]


def test_the_cli_refuses_what_the_correction_check_cannot_judge(capsys):
    code, lines, err = _cli(capsys, "--rollout-correction", "tis", "--kl-coef", "0.1")
    assert code == 2 and not lines and err.startswith("verify-unbiased: --kl-coef must be 0 with --rollout-correction")
    code, lines, err = _cli(capsys, "--staleness", "1", "--dynamic-sampling")
    assert code == 2 and not lines and err.startswith("verify-unbiased: --dynamic-sampling checks the refill rule")
    code, lines, err = _cli(capsys, "--rollout-correction", "seq_tis", "--method", "bppo")
    assert code == 2 and not lines and err.startswith("verify-unbiased: --method checks the methods' own losses")


def test_config_bounds_and_inert_keys():
    base = ("pruning.strategy=none", "pruning.r_q=0", "pruning.r_o=0")
    for key, bad in (("cap", "0.5"), ("low", "1.5"), ("high", "0.9"), ("seq_low", "1.01"), ("seq_high", "0.99")):
        with pytest.raises(ValueError, match=f"config key 'algorithm.rollout_correction_{key}'"):
            load_config("examples/tiny/addition.yaml", [*base, f"algorithm.rollout_correction_{key}={bad}"])
    on = [*base, "algorithm.rollout_correction=tis_seq_mask"]
    cfg = load_config(
        "examples/tiny/addition.yaml",
        [*on, "algorithm.rollout_correction_cap=3", "algorithm.rollout_correction_seq_low=0.99"],
    )
    assert config_warnings(cfg) == []  # a truncation and a geometric mask read the cap and the seq bounds
    cfg.algorithm.rollout_correction_low = 0.7  # the token mask's bound: not read by a geometric mask
    warned = [w.split(" is ignored")[0] for w in config_warnings(cfg)]
    assert warned == ["warning: algorithm.rollout_correction_low=0.7"]
    with pytest.raises(ValueError, match="rollout_correction"):
        load_config("examples/tiny/addition.yaml", [*base, "algorithm.rollout_correction=icepop"])


def test_first_step_warning_when_the_gap_is_measurable_and_nothing_corrects_it():
    m = {"train/rollout_kl_k3": 1e-4, "train/rollout_ratio_max": 1.03, "train/logprob_gap_vllm": 8e-3}
    line = rollout_gap_warning(m, "none")
    assert f"consider algorithm.rollout_correction={losses.RECOMMENDED_CORRECTION['bf16']}," in line  # the table's kind
    assert line and "algorithm.rollout_correction=none" in line and "= 0.0001 a token" in line
    assert rollout_gap_warning(m, "tis") is None
    assert rollout_gap_warning({**m, "train/rollout_kl_k3": 3e-13}, "none") is None  # fp32 rollouts
    assert rollout_gap_warning({}, "none") is None  # nothing trained


def test_train_metrics_take_the_min_of_a_min():
    a = {"loss": 1.0, "grad_norm": 1.0, "ratio_dev_max": 0.1, "logprob_gap_vllm": 0.0}
    rows = [
        {**a, "rollout_ratio_min": 0.9, "rollout_ratio_max": 1.1},
        {**a, "rollout_ratio_min": 0.7, "rollout_ratio_max": 1.3},
    ]

    class MB:
        density, tokens, completion_tokens = 1.0, 1, 1

    out = train_metrics(rows, [MB()])
    assert out["train/rollout_ratio_min"] == 0.7 and out["train/rollout_ratio_max"] == 1.3
