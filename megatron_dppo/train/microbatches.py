"""A step's mini-batches made trainable on this rank: the sequences packed into micro-batches
(THD rows, or padded rows where they are cheaper) and spread over the data-parallel ranks, and the
per-token inputs of the loss that a pass of the policy gives before the first update (pi_old, the
KL reference, the impurity of ReCo's token scale). An auxiliary loss packs its own micro-batches
(AuxLoss.pack: SSOPD's teacher/student pairs); the reweighting scales its tokens
(Reweighting.attach_token_scale)."""

from __future__ import annotations

import torch

from megatron_dppo.algorithms import packing
from megatron_dppo.algorithms.packing import PackLayout


def pack_samples(samples, lay: PackLayout):
    """Pack the mini-batch's sequences, spread the packs over DP ranks, build this rank's batches
    -> (batches, packing density)."""
    lengths = [packing.round_up(len(s.tokens), lay.pad_multiple) for s in samples]
    if lay.kind == "padded":
        packs = packing.pack_padded(lengths, lay.capacity)
    elif lay.kind == "ffd":
        packs = packing.pack_ffd(lengths, lay.capacity)
    else:
        packs = packing.pack(lengths, lay.capacity, lay.window)
    density = packing.density(lengths, packs, lay.capacity)
    mine = packing.balance_packs(packs, lengths, lay.dp_size)[lay.dp_rank]
    # An empty slot (fewer sequences than slots) still runs: every rank must step together.
    filler = packing.Sample(tokens=[lay.pad_id, lay.pad_id], prompt_len=2, weight=0.0)
    if samples and samples[0].routed_experts is not None:  # routing replay: the filler's routers replay too
        like = samples[0].routed_experts  # [tokens, layers, k]: the filler's 2 tokens to experts 0..k-1
        filler.routed_experts = torch.arange(like.shape[2], dtype=like.dtype).expand(2, *like.shape[1:]).clone()
    build = packing.build_padded_batch if as_padded_rows(packs, lengths, lay) else packing.build_thd_batch
    batches = [
        build([samples[i] for i in p] if p else [filler], pad_multiple=lay.pad_multiple, pad_id=lay.pad_id)
        for p in mine
    ]
    return batches, density


def as_padded_rows(packs, lengths, lay: PackLayout) -> bool:
    """Lay the packs out as padded rows instead of THD rows? Always for trainer.packing=padded.
    For packed micro-batches only on the local (non-TE) attention and when every pack's
    sequences are so close in length that padding them to their longest wastes under 5%: that
    path's THD row has a fixed per-sequence cost (length buckets, Megatron's per-sequence RoPE)
    that such little padding beats (docs/packing.md: THD rows ran 0.95x of padded ones on the
    addition task's near-uniform lengths). The packs, and so the density, stay the packer's;
    the decision is the same on every rank (it reads all packs)."""
    if lay.kind == "padded":
        return True
    if not lay.local_attention:
        return False
    return all(len(p) * max(lengths[i] for i in p) <= 1.05 * sum(lengths[i] for i in p) for p in packs if p)


def attach_logprobs(policy, method, microbatches, old: bool, ref: bool) -> None:
    """Old (and reference) log-probs with the same packed micro-batches, no gradients; when the
    reweighting needs it (ReCo's gini token scale) the pi_old pass also gives each position's impurity."""
    gini = method.reweighting.needs_impurity
    for attr, wanted, reference in (("old_logp", old, False), ("ref_logp", ref, True)):
        if not wanted:
            continue
        out = policy.compute_logprobs(microbatches, reference=reference, gini=gini and not reference)
        if out is None:  # not the last pipeline stage: the loss is computed elsewhere
            continue
        logps, impurities = out if gini and not reference else (out, None)
        for i, (mb, lp) in enumerate(zip(microbatches, logps)):
            setattr(mb, attr, (lp.float().cpu() * mb.loss_mask).view_as(mb.loss_mask))
            if impurities is not None:
                mb.token_scale = impurities[i].float().cpu() * mb.loss_mask  # the impurity until scaled
