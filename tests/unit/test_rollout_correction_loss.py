"""The rollout correction inside the micro-batch loss (issue 44): the weight multiplies the
policy-gradient term only, never the KL term (verl's objective; the reference is written out
here); a micro-batch without loss tokens (an idle data-parallel slot's filler) needs no rollout
log-probs; the sequences' geometric-mean ratios are measured; and a mask whose bounds lie outside
every measured ratio is named."""

import math

import pytest
import torch
from loss_batches import three_sequence_batch

from megatron_dppo.algorithms import losses, packing
from megatron_dppo.config import AlgorithmConfig
from megatron_dppo.train.metrics import idle_mask_line

VOCAB, PADDED, TEMP, DENOM, CAP, KL = 50, 64, 0.9, 40.0, 1.2, 0.3


def _logits(batch):
    return 3 * torch.randn(*batch.labels.shape, PADDED, generator=torch.Generator().manual_seed(6))


def _loss(batch, logits, **algorithm):
    from megatron_dppo.megatron import loss as loss_mod

    x = logits.clone().requires_grad_()
    loss, n, report = loss_mod.micro_batch_loss(
        batch,
        x,
        algorithm=AlgorithmConfig(**algorithm),
        vocab_size=VOCAB,
        temperature=TEMP,
        mode="train",
        denominator=DENOM,
    )
    loss.backward()
    return loss, x.grad, n, report


def _reference(batch, logits, kl_weighted: bool):
    """sum_t coef_t * (min(rho_t, cap) * pg_t + kl_coef * k3_t) written out; kl_weighted: the
    weight on the KL term too (the objective before issue 44, a negative control)."""
    from megatron_dppo.megatron import loss as loss_mod

    index = loss_mod.loss_positions(batch.loss_mask)
    x = logits.clone().requires_grad_()
    lp = torch.log_softmax(x[..., :VOCAB].float() / TEMP, -1).flatten(0, 1)
    lp = lp.gather(1, batch.labels.flatten()[:, None])[:, 0][index]
    old, ref = batch.old_logp.flatten()[index], batch.ref_logp.flatten()[index]
    rho = torch.exp(old - batch.rollout_logp.flatten()[index]).double().clamp(max=CAP)
    ratio, adv = torch.exp(lp - old), batch.advantages.flatten()[index]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    coef = batch.seq_weight[batch.seq_index.flatten()[index]].double() / DENOM  # token-mean
    kl_coef = coef * rho if kl_weighted else coef
    want = (pg * (coef * rho).float()).sum() + (KL * kl * kl_coef.float()).sum()
    want.backward()
    return want, x.grad


def test_the_correction_weighs_the_policy_gradient_term_and_not_the_kl_term(tp1):
    batch = three_sequence_batch()
    logits = _logits(batch)
    got, grad, _, _ = _loss(
        batch, logits, rollout_correction="tis", rollout_correction_cap=CAP, kl_coef=KL, kl_estimator="k3"
    )
    want, want_grad = _reference(batch, logits, kl_weighted=False)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert torch.allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    # The negative control: the weight on the whole token loss is another objective, told apart here.
    other, other_grad = _reference(batch, logits, kl_weighted=True)
    assert not torch.allclose(grad, other_grad, rtol=1e-3, atol=1e-6)
    assert abs(float(got) - float(other)) > 1e-4 * abs(float(other))


def test_without_a_kl_term_the_weight_is_on_the_whole_loss(tp1):
    """kl_coef = 0: the corrected loss is the plain aggregate with coef * w (what it always was)."""
    batch = three_sequence_batch()
    logits = _logits(batch)
    got, grad, _, _ = _loss(batch, logits, rollout_correction="tis", rollout_correction_cap=CAP)
    plain, plain_grad, _, _ = _loss(batch, logits)
    assert not torch.allclose(grad, plain_grad, rtol=1e-3)


def test_a_filler_micro_batch_needs_no_rollout_logprobs(tp1):
    """An idle DP slot trains a 2-token filler with no loss tokens (train/microbatches.pack_samples):
    under any correction it gives loss 0 and zero gradient, where it used to raise (every other
    rank then waited in the all-reduce)."""
    filler = packing.build_thd_batch([packing.Sample(tokens=[0, 0], prompt_len=2, weight=0.0)], pad_multiple=4)
    assert filler.rollout_logp is None
    # the trainer's log-prob passes attach pi_old and the reference to every micro-batch, the filler's too
    filler.old_logp = torch.zeros(filler.labels.shape)
    filler.ref_logp = torch.zeros(filler.labels.shape)
    for kind in losses.ROLLOUT_CORRECTIONS:
        loss, grad, n, report = _loss(filler, _logits(filler), rollout_correction=kind, kl_coef=KL)
        assert float(loss) == 0.0 and int(n) == 0 and not grad.abs().sum(), kind
        assert float(report["rollout_gap_tokens"]) == 0.0


def test_a_batch_with_loss_tokens_and_no_rollout_logprobs_is_still_refused(tp1):
    batch = three_sequence_batch()
    batch.rollout_logp = None
    with pytest.raises(ValueError, match="needs the rollout engine's log-probs"):
        _loss(batch, _logits(batch), rollout_correction="seq_mask")


def test_the_geometric_mean_range_is_measured():
    log_rho = torch.tensor([0.0, 0.1, 0.5, -0.1, -0.4, -0.3, 0.02], dtype=torch.float64)
    seq_index = torch.tensor([0] * 4 + [1] * 3)
    rollout = torch.full_like(log_rho, -1.0)
    m = losses.rollout_mismatch(rollout + log_rho, rollout, seq_index, 3)  # sequence 2 has no tokens
    geo = [math.exp(0.5 / 4), math.exp(-0.68 / 3)]
    assert float(m["rollout_geo_max"]) == pytest.approx(max(geo))
    assert float(m["rollout_geo_min"]) == pytest.approx(min(geo))


BOUNDS = dict(
    rollout_correction_low=0.5,
    rollout_correction_high=2.0,
    rollout_correction_seq_low=0.999,
    rollout_correction_seq_high=1.001,
)


def _metrics(token, seq):
    return {
        "train/rollout_ratio_min": token[0],
        "train/rollout_ratio_max": token[1],
        "train/rollout_seq_geo_min": seq[0],
        "train/rollout_seq_geo_max": seq[1],
    }


def test_a_mask_that_could_not_bind_is_named():
    """docs/gpus.md's bf16 gap (token ratios in [0.977, 1.032]): the token mask's [0.5, 2] masks
    nothing and is named; the geometric mask's own [0.999, 1.001] binds on a geometric range
    [0.997, 1.002] and is not; a range inside it is; the kinds without a mask never are."""
    bf16 = _metrics((0.977, 1.032), (0.997, 1.002))
    line = idle_mask_line(bf16, AlgorithmConfig(rollout_correction="mask", **BOUNDS))
    assert line and "rollout_correction=mask masked nothing" in line and "[0.977, 1.032]" in line
    assert "rollout_correction_low/_high [0.5, 2]" in line
    assert idle_mask_line(bf16, AlgorithmConfig(rollout_correction="tis_mask", **BOUNDS))
    assert idle_mask_line(bf16, AlgorithmConfig(rollout_correction="seq_mask", **BOUNDS)) is None
    assert idle_mask_line(bf16, AlgorithmConfig(rollout_correction="tis_seq_mask", **BOUNDS)) is None
    narrow = _metrics((0.977, 1.032), (0.9995, 1.0004))
    line = idle_mask_line(narrow, AlgorithmConfig(rollout_correction="seq_mask", **BOUNDS))
    assert line and "geometric-mean ratios ranged [0.9995, 1.0004]" in line
    wide = _metrics((0.3, 1.032), (0.997, 1.002))  # a token ratio below low: the token mask acted
    assert idle_mask_line(wide, AlgorithmConfig(rollout_correction="mask", **BOUNDS)) is None
    for kind in ("none", "tis", "seq_tis"):
        assert idle_mask_line(narrow, AlgorithmConfig(rollout_correction=kind, **BOUNDS)) is None
    assert idle_mask_line({}, AlgorithmConfig(rollout_correction="mask", **BOUNDS)) is None  # nothing measured
