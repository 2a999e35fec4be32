"""Worker: the rollout correction in Megatron's distributed step equals a single-process reference.

Run as `torchrun --nproc_per_node N correction_check.py` (or plain python for N=1). Every rank
builds the same random problem as grad_check.py, gives each completion the rollout engine's
log-probs (pi_old's plus noise, so rho = pi_old / mu is not 1), packs it with the trainer's own
train/microbatches.pack_samples (which gives an idle data-parallel slot its filler micro-batch),
and compares the Megatron loss and gradient with a plain-PyTorch reference on the HF model for
every algorithm.rollout_correction kind, with a KL term (the correction weighs the policy-gradient
term only). Two batches: the pruned batch in one pack per rank, and a starved mini-batch of one
sequence, so that at DP=2 one rank trains only the filler (which used to raise: issue 44).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grad_check import B, G, _mask, hf_model, make_problem, seq_logp  # noqa: E402

from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.algorithms.packing import PackLayout  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.train.microbatches import pack_samples  # noqa: E402

KL, CAP = 0.1, 1.3
BOUNDS = dict(rollout_correction_low=0.8, rollout_correction_high=1.25)  # tight enough to mask some tokens
SEQ_BOUNDS = dict(rollout_correction_seq_low=0.97, rollout_correction_seq_high=1.03)


def with_rollout_logp(samples, seed):
    """mu's log-probs: pi_old's plus noise of ~0.2 nats a token, fixed per sequence."""
    for s in samples:
        gen = torch.Generator().manual_seed(seed + s.seq_id)
        s.rollout_logp = s.old_logp + 0.2 * torch.randn(s.old_logp.shape, generator=gen)
    return samples


def reference(model, samples, cfg, denominator):
    """sum_t coef_t * (w_t * pg_t + kl_coef * kl_t) on the HF model, plain PyTorch; w_t from the
    library's losses.rollout_correction (its formulas are checked token by token against a
    written-out table in tests/unit/test_rollout_correction.py)."""
    model.zero_grad()
    masks = [_mask(s) for s in samples]
    lp = torch.cat([seq_logp(model, torch.as_tensor(s.tokens), s.prompt_len)[m] for s, m in zip(samples, masks)])
    cat = lambda attr: torch.cat([getattr(s, attr)[m] for s, m in zip(samples, masks)])  # noqa: E731
    seq_len = torch.tensor([int(m.sum()) for m in masks])
    seq_index = torch.repeat_interleave(torch.arange(len(samples)), seq_len)
    adv = torch.tensor([s.advantage for s in samples])[seq_index]
    old = cat("old_logp")
    pg, _ = losses.policy_loss(lp, old, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    kl = losses.kl_penalty(lp, cat("ref_logp"), cfg.kl_estimator)
    weight, _ = losses.rollout_correction(
        old,
        cat("rollout_logp"),
        seq_index,
        len(samples),
        cfg.rollout_correction,
        cap=cfg.rollout_correction_cap,
        low=cfg.rollout_correction_low,
        high=cfg.rollout_correction_high,
        seq_low=cfg.rollout_correction_seq_low,
        seq_high=cfg.rollout_correction_seq_high,
    )
    coef = losses.token_coefficients(
        seq_index, torch.tensor([s.weight for s in samples]), seq_len, cfg.loss_agg, denominator
    )
    loss = (pg * (coef * weight).float()).sum() + (cfg.kl_coef * kl * coef.float()).sum()
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, weight


def main():
    initialize_parallel(1, 1, seed=0)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg, model = hf_model()
    hf_sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    pruned, lengths, w_q, _ = make_problem(model, 0.5, 0.5, seed=7)
    batches = {"pruned": with_rollout_logp(pruned, 100), "starved": with_rollout_logp(pruned[:1], 100)}
    worst, checked, masked = 0.0, 0, 0.0
    for kind in losses.ROLLOUT_CORRECTIONS:
        algorithm = AlgorithmConfig(
            loss_agg="token-mean",
            clip_high=0.28,
            kl_coef=KL,
            rollout_correction=kind,
            rollout_correction_cap=CAP,
            **BOUNDS,
            **SEQ_BOUNDS,
        )
        policy = MegatronPolicy(cfg, OptimConfig(lr=1e-3), algorithm, with_reference=False)
        policy.load_hf_state_dict(hf_sd)
        for name, samples in batches.items():
            denom = losses.full_batch_denominator(
                "token-mean", num_prompts=B, group_size=G, completion_lengths=lengths, prompt_weight=w_q
            )
            ref_loss, ref, weight = reference(model, samples, algorithm, denom)
            masked = max(masked, float((weight == 0).double().mean()))
            lay = PackLayout("window", 10_000, 4, 4, 0, dp_rank, dp_size, local_attention=True)
            mbs, _ = pack_samples(samples, lay)
            for mb in mbs:  # the trainer's log-prob passes give the filler pi_old and the reference too
                if mb.old_logp is None:
                    mb.old_logp, mb.ref_logp = torch.zeros(mb.labels.shape), torch.zeros(mb.labels.shape)
            metrics = policy.forward_backward(mbs, denom)
            got = policy.hf_grads()
            num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref if k in got)
            den = sum(float(ref[k].pow(2).sum()) for k in ref if k in got)
            rel = (num / den) ** 0.5
            worst = max(worst, rel)
            assert abs(metrics["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (kind, name, metrics, ref_loss)
            assert rel < 1e-5, f"{kind} {name}: relative grad error {rel}"
            checked += 1
            if dist.get_rank() == 0:
                print(
                    f"ok dp={dp_size} {kind:12s} {name:8s} sequences={len(samples)} loss={ref_loss:.6f} rel={rel:.2e}"
                )
    assert checked == 2 * len(losses.ROLLOUT_CORRECTIONS), checked
    assert masked > 0, "no mask bound bound on this problem: the mask kinds were not exercised"
    if dist.get_rank() == 0:
        print(f"CORRECTION CHECK PASSED worst relative error {worst:.2e}")
    destroy_parallel()


if __name__ == "__main__":
    main()
