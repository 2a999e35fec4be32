"""torchrun --nproc_per_node 2 tests/dist/workers/model/moe_worker.py

A tiny random Qwen3 MoE (8 experts, top-2, one dense layer among the MoE ones) built by
megatron/moe.py equals transformers' Qwen3MoeForCausalLM: the log-probs of a packed THD row
(ragged sequences, padding between them) equal each sequence run alone through transformers,
and the gradients of their sum equal transformers' gradients (fp32, 1e-5 of the largest), first at expert
parallel 1 (both ranks alike), then at EP=2 with each rank on its own batch: there the tokens of
both ranks reach each expert through the alltoall dispatcher, so an expert's gradient is
transformers' gradient over both batches, and every other gradient that of the rank's own batch.
Also with norm_topk_prob=false (softmax over all experts, no renormalisation) and
decoder_sparse_step=2 (every second layer sparse). Each rank's parameter count equals what
`megatron-dppo plan` counts for it (plan.stage_params + stage_expert_params)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import common  # noqa: E402
from tiny_models import hf_checkpoint_tensors, hf_reference, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.algorithms.packing import Sample, build_thd_batch  # noqa: E402
from megatron_dppo.jobs import plan  # noqa: E402
from megatron_dppo.megatron import build_gpt_model, destroy_parallel, initialize_parallel, token_logprobs  # noqa: E402
from megatron_dppo.megatron.attention import packed_seq_params  # noqa: E402
from megatron_dppo.megatron.hf_load import expert_rank_layout  # noqa: E402
from megatron_dppo.model import qwen3  # noqa: E402
from megatron_dppo.model.arch import Arch  # noqa: E402

TOL = 1e-5
LENGTHS = ((7, 19, 3, 12), (5, 11, 16))  # one batch per rank at EP=2


def megatron_run(model, seqs):
    """Packed THD row (padding to a multiple of 4 between sequences) -> per-sequence log-probs,
    and {local name: grad} of their sum."""
    batch = build_thd_batch([Sample(tokens=s.tolist(), prompt_len=1) for s in seqs], pad_multiple=4)
    model.zero_grad(set_to_none=True)
    logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=packed_seq_params(batch))
    logp = token_logprobs(logits, batch.labels, vocab_size=common.VOCAB)[0]
    starts = batch.cu_seqlens_padded.tolist()
    packed = [logp[a : a + len(s) - 1] for a, s in zip(starts, seqs)]
    sum(x.sum() for x in packed).backward()
    return [x.detach() for x in packed], {n: p.grad for n, p in model.named_parameters()}


def local(full_mg: dict, layout) -> dict:
    ep_rank, ep_size, _, _ = expert_rank_layout()
    return qwen3.shard_for_rank(full_mg, layout, 0, 1, 0, 1, ep_rank=ep_rank, ep_size=ep_size)


def check(ep: int, cfg, hf, batches, what: str):
    initialize_parallel(tp=1, pp=1, seed=0, ep=ep)
    rank = dist.get_rank()
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=128)
    model = build_gpt_model(cfg)
    assert sum(1 for n, _ in model.named_parameters() if n.endswith("router.weight")) == sum(layout.moe_layers)
    # `megatron-dppo plan` counts what this rank holds: its experts and the dense rest.
    arch = Arch.from_hf(cfg.to_dict())
    counted = plan.stage_params(arch, 1, 1)["only"] + plan.stage_expert_params(arch, ep, 1, 1)["only"]
    assert counted == sum(p.numel() for p in model.parameters()), (counted, ep)
    weights = local(qwen3.hf_to_megatron(hf_checkpoint_tensors(hf), layout), layout)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    mine = batches[rank % len(batches)] if ep > 1 else batches[0]
    logp, grads = megatron_run(model, mine)
    ref_logp, ref_own = hf_reference(hf, mine)
    # At EP=2 an expert sees the tokens of every rank's batch: sum transformers' gradients.
    ref_all = ref_own
    if ep > 1:
        other = hf_reference(hf, batches[1 - rank])[1]
        ref_all = {k: ref_own[k] + other[k] for k in ref_own}
    ref_own, ref_all = (local(qwen3.hf_to_megatron(r, layout), layout) for r in (ref_own, ref_all))
    lerr = max((a - b).abs().max().item() for a, b in zip(logp, ref_logp))
    gerr = gmax = 0.0  # max |grad diff| relative to the largest reference gradient
    for n, g in grads.items():
        ref = (ref_all if qwen3.expert_index(n) is not None else ref_own)[n]
        gerr, gmax = max(gerr, (g - ref).abs().max().item()), max(gmax, ref.abs().max().item())
    gerr /= gmax
    print(
        f"[rank {rank}] {what} EP={ep}: {sum(map(len, logp))} tokens, max |logp diff| {lerr:.2e}, "
        f"max |grad diff| / max |grad| {gerr:.2e} (max |grad| {gmax:.1f})",
        flush=True,
    )
    assert lerr < TOL and gerr < TOL, (what, ep, lerr, gerr)
    destroy_parallel(world=False)


def main():
    g = torch.Generator().manual_seed(3)
    batches = [[torch.randint(0, common.VOCAB, (n,), generator=g) for n in lens] for lens in LENGTHS]
    variants = {
        "top-2 renormalised, layer 1 dense": {},
        "top-2 of softmax, decoder_sparse_step=2": dict(
            norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]
        ),
    }
    for what, overrides in variants.items():
        cfg, hf = tiny_qwen3_moe_model(0, **overrides)
        for ep in (1, 2):
            check(ep, cfg, hf, batches, what)
    dist.barrier()  # every rank past its last collective before gloo is torn down (a teardown abort seen in CI)
    dist.destroy_process_group()
    common.log("OK")


if __name__ == "__main__":
    main()
