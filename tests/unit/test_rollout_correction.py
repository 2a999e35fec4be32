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
from megatron_dppo.jobs.verify_unbiased import CheckConfig, run_check
from megatron_dppo.train.preflight import config_warnings
from megatron_dppo.train.trainer import _train_metrics, rollout_gap_warning

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


def test_dppo_stays_unbiased_with_the_correction_on_every_token():
    res = run_check(CheckConfig(strategy="dppo", rollout_correction="tis", draws=600))
    assert res.unbiased, res


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

    out = _train_metrics(rows, [MB()])
    assert out["train/rollout_ratio_min"] == 0.7 and out["train/rollout_ratio_max"] == 1.3
