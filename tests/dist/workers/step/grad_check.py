"""Worker: the Megatron DPPO gradient equals a single-process HF reference, for a layout.

Run as `torchrun --nproc_per_node N grad_check.py --tp T --pp P` (or plain python for N=1).
Every rank builds the same random problem (seeded), computes the reference itself with plain
PyTorch on the HF model, and compares it with the Megatron gradient for each loss aggregation,
with 1 and with several micro-batches per rank.
"""

import argparse
import math
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from tiny_models import tiny_qwen3_model

from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.packing import Sample, balance_packs, build_thd_batch, pack
from megatron_dppo.algorithms.pruning import prune_completions, prune_prompts
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel
from megatron_dppo.megatron.policy import MegatronPolicy

B, G, MAX_NEW, VOCAB = 4, 4, 8, 50


def hf_model(seed=0):
    return tiny_qwen3_model(seed, vocab_size=VOCAB, max_position_embeddings=64)


def seq_logp(model, tokens, prompt_len):
    logits = model(tokens[None]).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
    return logp[prompt_len - 1 :]


@torch.no_grad()
def mean_entropy(model, samples):
    """The policy's mean next-token entropy over the samples' completion tokens (the trained ones)."""
    ents = []
    for s in samples:
        tokens = torch.as_tensor(s.tokens)
        logp = torch.log_softmax(model(tokens[None]).logits[0, s.prompt_len - 1 : -1].float(), -1)
        ents.append((-(logp.exp() * logp).sum(-1))[_mask(s)])
    return float(torch.cat(ents).double().mean())


def _mask(s) -> torch.Tensor:
    """bool over the sample's completion tokens: its per-token loss mask (all, without one)."""
    n = len(s.tokens) - s.prompt_len
    return torch.ones(n, dtype=torch.bool) if s.loss_mask is None else torch.as_tensor(s.loss_mask) > 0


def make_problem(model, r_q, r_o, seed, mask_seed=None, reweight=True, token_masks=False):
    """A fixed random batch (from `seed`) pruned with masks drawn from `mask_seed`. token_masks:
    about a third of each completion's tokens carry no loss (never all of them), as a per-token
    loss mask on the samples."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, VOCAB, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen) for _ in range(B)
    ]
    comps = [
        [
            torch.randint(3, VOCAB, (int(torch.randint(1, MAX_NEW + 1, (1,), generator=gen)),), generator=gen)
            for _ in range(G)
        ]
        for _ in range(B)
    ]
    rewards = (torch.rand(B, G, generator=gen) < 0.5).float()
    rewards[0, :2] = torch.tensor([0.0, 1.0])  # at least one informative group
    adv = group_advantages(rewards)
    scores = torch.rand(B, generator=gen)
    scores[1] = math.nan
    mask_gen = gen if mask_seed is None else torch.Generator().manual_seed(mask_seed)
    keep_q, w_q, keep_o, w_o = draw_masks(adv, scores, r_q, r_o, mask_gen, reweight)
    # Fixed per (prompt, completion, token), whichever sequences the masks keep.
    noise = 0.3 * torch.randn(2, B, G, MAX_NEW, generator=torch.Generator().manual_seed(seed + 1))
    samples = []
    with torch.no_grad():
        for q in range(B):
            if not keep_q[q]:
                continue
            for i in range(G):
                if not keep_o[q, i]:
                    continue
                tokens = torch.cat([prompts[q], comps[q][i]])
                lp = seq_logp(model, tokens, len(prompts[q]))
                loss_mask = None
                if token_masks:
                    keep = torch.rand(len(lp), generator=torch.Generator().manual_seed(seed + 7 * q + i)) > 0.35
                    keep[int(torch.randint(len(lp), (1,), generator=torch.Generator().manual_seed(q * G + i)))] = True
                    loss_mask = keep.float().tolist()
                samples.append(
                    Sample(
                        tokens=tokens,
                        prompt_len=len(prompts[q]),
                        advantage=float(adv[q, i]),
                        weight=float(w_q[q] * w_o[q, i]),
                        seq_id=q * G + i,
                        old_logp=lp + noise[0, q, i, : len(lp)],
                        ref_logp=lp + noise[1, q, i, : len(lp)],
                        loss_mask=loss_mask,
                    )
                )
    rolled = keep_q.nonzero().flatten()
    lengths = torch.tensor([[len(c) for c in comps[q]] for q in rolled.tolist()])
    return samples, lengths, w_q[rolled], (adv, scores)


def draw_masks(adv, scores, r_q, r_o, gen, reweight=True):
    """The library's two pruning levels; without `reweight` (a negative control) the kept
    sequences lose their Horvitz-Thompson weights."""
    keep_q, w_q = prune_prompts(scores, r_q, gen)
    keep_o, w_o = prune_completions(adv, r_o, gen)
    if not reweight:
        w_q, w_o = keep_q.float(), keep_o.float()
    return keep_q, w_q, keep_o, w_o


def reference_grads(model, samples, loss_cfg, denominator):
    """The plain-PyTorch loss and gradient on the HF model: only the loss-masked tokens count
    (a sequence's length, its GSPO ratio and its token mean are over them)."""
    model.zero_grad()
    masks = [_mask(s) for s in samples]
    lp = torch.cat([seq_logp(model, torch.as_tensor(s.tokens), s.prompt_len)[m] for s, m in zip(samples, masks)])
    seq_len = torch.tensor([int(m.sum()) for m in masks])
    seq_index = torch.repeat_interleave(torch.arange(len(samples)), seq_len)
    adv = torch.tensor([s.advantage for s in samples])[seq_index]
    token_loss, _ = losses.policy_loss(
        lp,
        torch.cat([s.old_logp[m] for s, m in zip(samples, masks)]),
        adv,
        clip_low=loss_cfg.clip_low,
        clip_high=loss_cfg.clip_high,
        ratio_type=loss_cfg.ratio_type,
        seq_index=seq_index,
        num_seqs=len(samples),
        ref_logp=torch.cat([s.ref_logp[m] for s, m in zip(samples, masks)]),
        kl_coef=loss_cfg.kl_coef,
    )
    coef = losses.token_coefficients(
        seq_index, torch.tensor([s.weight for s in samples]), seq_len, loss_cfg.loss_agg, denominator
    )
    loss = losses.aggregate(token_loss, coef)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def my_microbatches(samples, capacity, dp_rank, dp_size):
    lengths = [len(s.tokens) for s in samples]
    packs = pack(lengths, capacity, window=4)
    per_rank = balance_packs(packs, lengths, dp_size)
    return [build_thd_batch([samples[i] for i in p], pad_multiple=4) for p in per_rank[dp_rank]]  # 4: TP*2


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[k].flatten().double() for k in sorted(grads)])


def monte_carlo(policy, model, draws):
    """Mean of the Megatron DPPO gradient over mask draws vs the unpruned gradient.

    With the parameters fixed, the gradient of sum_s c_s * loss_s is sum_s c_s * grad(loss_s):
    so the per-sequence gradients U_s are taken through the Megatron path once (every sequence
    of the batch packed and spread over the DP ranks as usual, weight 1 on s and 0 elsewhere),
    and a draw's gradient is c @ U with c its DPPO weights over the full-batch denominator.
    That identity is checked on whole pruned batches run through Megatron (spot checks), so
    the many cheap draws still measure the Megatron path. Then only the draws' coefficients are
    needed: mean gradient = mean(c) @ U, and the Monte Carlo variance tr(U^T Cov(c) U)."""
    import megatron.core.parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rank0 = dist.get_rank() == 0

    def megatron_grad(samples, denom):
        policy.forward_backward(my_microbatches(samples, 24, dp_rank, dp_size), denom)
        return _flat(policy.hf_grads())

    samples, _, _, (adv, scores) = make_problem(model, 0.0, 0.0, seed=11)  # every sequence, weight 1
    S = len(samples)
    assert S == B * G and [s.seq_id for s in samples] == list(range(S))
    denom = losses.full_batch_denominator(policy.algorithm.loss_agg, num_prompts=B, group_size=G)
    U = torch.stack(
        [megatron_grad([replace(s, weight=float(k == j)) for k, s in enumerate(samples)], 1.0) for j in range(S)]
    )  # [S, params]
    full = megatron_grad(samples, denom)
    worst = float((U.sum(0) / denom - full).norm() / full.norm())
    for d in range(3):  # spot checks: pruned batches, straight through Megatron, vs c @ U
        kept, _, _, _ = make_problem(model, 0.5, 0.5, seed=11, mask_seed=500 + d)
        c = torch.zeros(S, dtype=torch.float64)
        c[[s.seq_id for s in kept]] = torch.tensor([s.weight for s in kept], dtype=torch.float64) / denom
        worst = max(worst, float((c @ U - megatron_grad(kept, denom)).norm() / full.norm()))
    if rank0:
        print(f"per-sequence gradients through Megatron: combined vs whole batches, worst rel.err {worst:.2e}")
    assert worst < 1e-5, f"the per-sequence combination does not reproduce the Megatron gradient ({worst})"

    gram = U @ U.T
    # The draws: prompt masks one by one, completion masks in one call over `draws` copies of
    # the batch (every row is pruned independently). The negative controls use the same masks.
    gen = torch.Generator().manual_seed(1000)
    prompt_masks = [prune_prompts(scores, 0.5, gen) for _ in range(draws)]
    keep_q = torch.stack([k for k, _ in prompt_masks])  # [draws, B]
    w_q = torch.stack([w for _, w in prompt_masks])
    keep_o, w_o = prune_completions(adv.repeat(draws, 1), 0.5, gen)
    keep_o, w_o = keep_o.view(draws, B, G), w_o.view(draws, B, G)
    variants = {
        "dppo": w_q[:, :, None] * w_o,
        "unweighted": (keep_q[:, :, None] & keep_o).float(),  # no reweighting
        "dppo x1.1": 1.1 * w_q[:, :, None] * w_o,
    }  # a 10% bias
    results = {}
    for name, weights in variants.items():
        coefs = weights.reshape(draws, S).double() / denom
        cov = torch.cov(coefs.T)
        rel = float((coefs.mean(0) @ U - full).norm() / full.norm())
        se = math.sqrt(max(float((cov * gram).sum()), 0.0) / draws) / float(full.norm())
        results[name] = (rel, se)
        if rank0:
            print(f"monte carlo {name}: draws={draws} rel.err={rel:.4f} mc.s.e.={se:.4f}")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument(
        "--negative-control",
        action="store_true",
        help="normalise per token count the way Megatron does by default: must FAIL the check",
    )
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--monte-carlo", type=int, default=0, help="mask draws for the unbiasedness check")
    args = ap.parse_args()
    initialize_parallel(args.tp, args.pp, seed=0)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg, model = hf_model()
    hf_sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if args.monte_carlo:
        policy = MegatronPolicy(cfg, OptimConfig(), AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_high=0.28))
        policy.load_hf_state_dict(hf_sd)
        res = monte_carlo(policy, model, args.monte_carlo)
        # Unbiased: the error is the noise, whose norm averages the s.e. (3 s.e.: ~1e-3 false alarms).
        rel, se = res["dppo"]
        assert se <= 0.03, f"too few draws to detect a 10% bias (s.e. {se})"
        assert rel < 3 * se, f"DPPO mean gradient off by {rel} (Monte Carlo s.e. {se})"
        for name in ("unweighted", "dppo x1.1"):
            rel_b, se_b = res[name]
            assert rel_b > 3 * se_b, f"negative control {name!r} not detected: {rel_b} vs s.e. {se_b}"
        if dist.get_rank() == 0:
            print("MONTE CARLO PASSED")
        destroy_parallel()
        return
    cases = [  # (aggregation, ratio, KL coefficient, per-token loss masks)
        ("seq-mean-token-mean", "token", 0.0, False),
        ("token-mean", "token", 0.1, False),
        ("seq-mean-token-sum-norm", "token", 0.0, False),
        ("seq-mean-token-mean", "sequence", 0.0, False),
        ("seq-mean-token-mean", "token", 0.1, True),
        ("token-mean", "sequence", 0.0, True),
    ]
    worst, checked = 0.0, 0
    for agg, ratio_type, kl, token_masks in cases:
        loss_cfg = AlgorithmConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, ratio_type=ratio_type, kl_coef=kl)
        policy = MegatronPolicy(
            cfg,
            OptimConfig(lr=1e-3),
            loss_cfg,
            with_reference=False,
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute,
        )
        policy.load_hf_state_dict(hf_sd)
        if args.negative_control:
            from megatron.core.distributed import finalize_model_grads

            policy.model.module.config.finalize_model_grads_func = finalize_model_grads
        for r in (0.0, 0.5):
            samples, lengths, w_q, _ = make_problem(model, r, r, seed=7, token_masks=token_masks)
            denom = losses.full_batch_denominator(
                agg,
                num_prompts=B,
                group_size=G,
                completion_lengths=lengths,
                prompt_weight=w_q,
                max_response_length=MAX_NEW,
            )
            ref_loss, ref = reference_grads(model, samples, loss_cfg, denom)
            ref_entropy = mean_entropy(model, samples)
            for capacity in (10_000, 24):  # one micro-batch per rank, then several
                mbs = my_microbatches(samples, capacity, dp_rank, dp_size)
                metrics = policy.forward_backward(mbs, denom)
                got = policy.hf_grads()
                num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref if k in got)
                den = sum(float(ref[k].pow(2).sum()) for k in ref if k in got)
                rel = math.sqrt(num / den)
                worst = max(worst, rel)
                assert got.keys() == {k for k in ref if k != "lm_head.weight"}, sorted(got.keys() ^ ref.keys())
                assert abs(metrics["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (metrics["loss"], ref_loss)
                assert abs(metrics["entropy"] - ref_entropy) <= 1e-5 * ref_entropy, (metrics["entropy"], ref_entropy)
                assert rel < 1e-5, f"{agg} {ratio_type} kl={kl} r={r} capacity={capacity}: relative grad error {rel}"
                checked += 1
                if dist.get_rank() == 0:
                    print(
                        f"ok tp={args.tp} pp={args.pp} dp={dp_size} {agg:24s} {ratio_type:8s} kl={kl} r={r} "
                        f"masks={token_masks} "
                        f"micro-batches/rank={len(mbs)} loss={metrics['loss']:.6f} rel.grad.err={rel:.2e}"
                    )
    assert checked == 2 * 2 * len(cases), f"only {checked} of the {2 * 2 * len(cases)} comparisons ran"
    if dist.get_rank() == 0:
        print(f"GRAD CHECK PASSED worst relative error {worst:.2e}")
    destroy_parallel()


if __name__ == "__main__":
    main()
