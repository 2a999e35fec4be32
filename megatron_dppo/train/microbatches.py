"""A step's mini-batches made trainable on this rank: the sequences packed into micro-batches
(THD rows, or padded rows where they are cheaper) and spread over the data-parallel ranks, SSOPD's
teacher/student micro-batches beside them, and the per-token inputs of the loss that a pass of the
policy gives before the first update (pi_old, the KL reference, ReCo's token scale)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dppo.algorithms import packing
from megatron_dppo.algorithms.methods import reco
from megatron_dppo.run import collectives as mdist


@dataclass(frozen=True)
class PackLayout:
    """How this rank packs: trainer.packing / max_tokens_per_microbatch / pack_window, the THD pad
    multiple (TP, sequence parallel), its data-parallel place, and whether the policy runs the
    local (non-TE) attention."""

    kind: str
    capacity: int
    window: int
    pad_multiple: int
    pad_id: int
    dp_rank: int
    dp_size: int
    local_attention: bool


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


def pack_aux(minibatches, lay: PackLayout, *, ssopd_cfg, tokenizer, renderer, max_context: int) -> dict:
    """SSOPD's teacher/student micro-batches of each mini-batch (megatron_dppo/algorithms/distill.py)."""
    from megatron_dppo.algorithms.distill import aux_microbatches

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    tokens = {"header": ids(ssopd_cfg.solution_header), "instruction": ids(ssopd_cfg.instruction)}
    tokens["suffix"] = ids(renderer.generation_suffix())  # the block goes before it
    tokens["strip"] = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
    layout = dict(
        max_context=max_context,
        capacity=lay.capacity,
        window=lay.window,
        dp_rank=lay.dp_rank,
        dp_size=lay.dp_size,
        pad_multiple=lay.pad_multiple,
        pad_id=lay.pad_id,
    )
    pairs = skipped = positions = 0
    for mb in minibatches:
        mb.aux_microbatches, stats = aux_microbatches(
            mb.aux_pairs, cfg=ssopd_cfg, num_prompts=mb.num_prompts, tokens=tokens, layout=layout
        )
        pairs, skipped, positions = pairs + stats.pairs, skipped + stats.skipped, positions + stats.positions
    return {"ssopd/pairs": pairs, "ssopd/skipped": skipped, "ssopd/positions": positions}


def attach_logprobs(policy, method, microbatches, old: bool, ref: bool) -> None:
    """Old (and reference) log-probs with the same packed micro-batches, no gradients; with
    ReCo's gini token scale the pi_old pass also gives each position's impurity."""
    gini = method.reweighting == "reco" and method.reco.token_scale == "gini"
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


def attach_token_scale(method, minibatches) -> float:
    """ReCo's c_t = g_t / mean g over the step's trained tokens with A != 0, every micro-batch
    and rank, each token weighted by its sequence's weight (docs/methods.md 2.1.3;
    reco.step_mean_terms says why). g is the Gini impurity from the pi_old pass, or
    pi_old(a)(1 - pi_old(a)) (bernoulli)."""
    last_stage = [mbt for mb in minibatches for mbt in mb.microbatches if mbt.old_logp is not None]
    num = den = 0.0
    for mbt in last_stage:
        if method.reco.token_scale == "bernoulli":
            mbt.token_scale = reco.bernoulli_impurity(mbt.old_logp) * mbt.loss_mask
        part = reco.step_mean_terms(mbt.token_scale, mbt.loss_mask, mbt.advantages, mbt.seq_index, mbt.seq_weight)
        num, den = num + part[0], den + part[1]
    num, den = mdist.all_reduce_sum([num, den])  # replicas (TP) add to both alike
    mean = num / den if den > 0 else 0.0
    for mbt in last_stage:
        mbt.token_scale = reco.token_scale(mbt.token_scale, mean) * mbt.loss_mask
    return mean
