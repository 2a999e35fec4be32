"""torchrun --nproc_per_node 2 tests/dist/workers/model/tp_worker.py

TP=2 equals TP=1 for the same weights (log-probs, entropy, loss, gradients); CPU
initialisation is TP-invariant; packed THD log-probs and gradients equal per-sequence runs at
TP=1 and TP=2 (ragged lengths, with and without padding between sequences, bucketed and
per-sequence attention)."""

import itertools

import common
import torch

from megatron_dppo.algorithms.packing import Sample, build_thd_batch
from megatron_dppo.megatron import (
    build_gpt_model,
    destroy_parallel,
    initialize_parallel,
    token_logprobs,
    token_logprobs_and_entropy,
)
from megatron_dppo.megatron.attention import PackedDotProductAttention, packed_seq_params

SEED = 1234
TOL = 1e-5


def batch_logprobs(model, ids):
    """Plain [b, s] batch: (logp, entropy) of next tokens, [b, s-1] each."""
    pos = torch.arange(ids.size(1)).expand_as(ids)
    logits = model(ids, pos, None)[:, :-1]
    return token_logprobs_and_entropy(logits, ids[:, 1:], vocab_size=common.VOCAB)


def check_blocks(model, ids):
    """megatron/logprobs.py's blocks of positions: 5-position blocks (several rounds of the TP
    all-reduces) give the values and gradients of one block, bit for bit, and the entropy the
    loss reports (no gradient, same pass) is the differentiable entropy's."""
    from megatron_dppo.megatron.logprobs import token_logprobs_detached_entropy

    pos = torch.arange(ids.size(1)).expand_as(ids)
    logits = model(ids, pos, None)[:, :-1].detach()
    weight = torch.randn(ids.size(0), ids.size(1) - 1, generator=torch.Generator().manual_seed(3))
    out = {}
    for name, chunk in (("one", 1 << 25), ("small", 5 * logits.size(-1))):
        leaf = logits.clone().requires_grad_()
        logp, ent = token_logprobs_detached_entropy(
            leaf, ids[:, 1:], vocab_size=common.VOCAB, temperature=0.8, chunk_elements=chunk
        )
        (logp * weight).sum().backward()
        out[name] = logp.detach(), ent, leaf.grad
    _, ent_ref = token_logprobs_and_entropy(logits, ids[:, 1:], vocab_size=common.VOCAB, temperature=0.8)
    same = [torch.equal(a, b) for a, b in zip(out["one"], out["small"])] + [torch.equal(out["one"][1], ent_ref)]
    common.log(f"blocked log-probs (1 vs {-(-logits[..., 0].numel() // 5)} blocks): equal {same}")
    assert all(same), same


def check_packing(model, lengths=(7, 41, 5, 10, 2, 23, 9, 70)):
    """Log-probs and grads of every sequence of a packed row equal the sequence run alone, for
    ragged long-tailed lengths, with padding after each sequence (pad_multiple 4, as under
    sequence parallelism: the padded offsets are passed as cu_seqlens) and without (pad_multiple
    1), through the bucketed kernel and the per-sequence loop."""
    seqs = common.sequences(lengths, seed=1)
    model.zero_grad(set_to_none=True)
    alone = []
    for seq in seqs:
        ids1, pos1, labels1 = common.alone(seq)
        lp = token_logprobs(model(ids1, pos1, None), labels1, vocab_size=common.VOCAB)[0, :-1]
        alone.append(lp.detach())
        lp.sum().backward()
    grads_alone = common.full_grads(model)

    samples = [Sample(tokens=s.tolist(), prompt_len=1) for s in seqs]
    for multiple, impl in itertools.product((4, 1), ("bucketed", "loop")):
        for module in model.modules():  # model.thd_attention, as the layer spec would have set it
            if isinstance(module, PackedDotProductAttention):
                module.thd_impl = impl
        batch = build_thd_batch(samples, pad_multiple=multiple)
        params = packed_seq_params(batch)
        # the padded offsets are the boundaries (padding counted in its sequence): issue 22.4
        assert params.cu_seqlens_q_padded is None
        assert params.cu_seqlens_q.tolist() == batch.cu_seqlens_padded.tolist()
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(
            model(batch.tokens, batch.position_ids, None, packed_seq_params=params),
            batch.labels,
            vocab_size=common.VOCAB,
        )[0]
        starts = batch.cu_seqlens_padded.tolist()
        packed = [logp[s : s + len(q) - 1] for s, q in zip(starts, seqs)]
        sum(x.sum() for x in packed).backward()
        err = max((a - b).abs().max().item() for a, b in zip(packed, alone))
        gerr = common.max_diff(common.full_grads(model), grads_alone)
        common.log(f"packing (pad_multiple {multiple}, {impl}): logp err {err:.2e}, grad err {gerr:.2e}")
        assert err < TOL and gerr < TOL, (multiple, impl, err, gerr)


def main():
    cfg = common.tiny_config()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, common.VOCAB, (3, 24), generator=g)

    # TP=1 reference (world of 2 = DP 2; both ranks compute the same thing).
    initialize_parallel(tp=1, pp=1, seed=SEED)
    ref_init = common.full_params(build_gpt_model(cfg, make_vocab_size_divisible_by=32))
    model = build_gpt_model(cfg)
    full = common.full_params(model)
    logp1, ent1 = batch_logprobs(model, ids)
    loss1 = -logp1.mean()
    loss1.backward()
    grads1 = common.full_grads(model)
    check_packing(model)
    destroy_parallel(world=False)

    initialize_parallel(tp=2, pp=1, seed=SEED)
    # use_cpu_initialization draws full master weights from the same seed on every rank:
    # the TP=2 model is the TP=1 model sharded (when the padded vocab is the same: 64 here).
    init2 = build_gpt_model(cfg, make_vocab_size_divisible_by=32)
    init_err = common.max_diff(common.shard(init2, ref_init), common.full_params(init2))
    assert init_err == 0.0, f"CPU init is not TP-invariant: {init_err}"

    model = build_gpt_model(cfg)  # vocab padded to 256 here (128 at TP=1): masked away
    assert model.vocab_size == 256
    common.load_full(model, full)
    logp2, ent2 = batch_logprobs(model, ids)
    loss2 = -logp2.mean()
    loss2.backward()
    common.finalize_grads(model)
    grad_err = common.max_diff(common.shard(model, grads1), common.full_grads(model))
    errs = dict(
        loss=abs(loss1.item() - loss2.item()),
        logp=(logp1 - logp2).abs().max().item(),
        entropy=(ent1 - ent2).abs().max().item(),
        grad=grad_err,
    )
    common.log("TP=2 vs TP=1:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert all(v < TOL for v in errs.values()), errs
    check_blocks(model, ids)
    check_packing(model)
    destroy_parallel()
    common.log("OK")


if __name__ == "__main__":
    main()
