"""torchrun --nproc_per_node 2 tests/dist/workers/model/pp_worker.py

Through Megatron's pipeline schedules (get_forward_backward_func): PP=2 gives the single-stage
loss, log-probs and gradients for the same weights; packed THD log-probs and gradients equal
per-sequence runs at PP=2 (ragged lengths, with and without padding between sequences); a few
optimizer steps at PP=2 reduce the loss."""

import common
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dppo.algorithms.packing import Sample, build_thd_batch
from megatron_dppo.megatron import (
    build_gpt_model,
    destroy_parallel,
    initialize_parallel,
    token_logprobs,
)
from megatron_dppo.megatron.attention import packed_seq_params

SEED = 4321
TOL = 1e-5


def forward_step(data_iterator, model):
    ids, pos, labels, params, mask = next(data_iterator)
    logits = model(ids, pos, None, packed_seq_params=params)

    def loss_func(logits):
        logp = token_logprobs(logits, labels, vocab_size=common.VOCAB)
        loss = -(logp * mask).sum()
        # clone: the schedule divides the returned loss in place
        return loss, mask.sum().int(), {"logp": logp.detach(), "loss": loss.detach().clone()}

    return logits, loss_func


def run(model, micro_batches, forward_only=False):
    """One schedule call over same-shaped micro-batches; on the last stage returns the
    loss_func dicts (one per micro-batch), elsewhere []."""
    ids = micro_batches[0][0]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=ids.size(1),
        micro_batch_size=ids.size(0),
        forward_only=forward_only,
    )


def plain_batch(ids):
    labels = torch.zeros_like(ids)
    labels[:, :-1] = ids[:, 1:]
    mask = torch.zeros(ids.shape)
    mask[:, :-1] = 1.0
    return ids, torch.arange(ids.size(1)).expand_as(ids), labels, None, mask


def packing_case(model, seqs, multiple):
    """Sum of log-probs of a packed micro-batch (the trainer's THD batch, each sequence padded
    to `multiple`; 1 = no padding) vs of each sequence alone: returns
    (per-sequence packed logp, per-sequence alone logp, packed grads, alone grads)."""
    batch = build_thd_batch([Sample(tokens=q.tolist(), prompt_len=1) for q in seqs], pad_multiple=multiple)
    ids, pos, labels, params = batch.tokens, batch.position_ids, batch.labels, packed_seq_params(batch)
    assert params.cu_seqlens_q_padded is None  # the padded offsets are the boundaries (issue 22.4)
    assert params.cu_seqlens_q.tolist() == batch.cu_seqlens_padded.tolist()
    starts = batch.cu_seqlens_padded.tolist()
    mask = torch.zeros(labels.shape)  # real next-token positions only
    for s, q in zip(starts, seqs):
        mask[0, s : s + len(q) - 1] = 1.0
    model.zero_grad(set_to_none=True)
    out = run(model, [(ids, pos, labels, params, mask)])
    common.finalize_grads(model)
    grads_packed = common.full_grads(model)
    packed = [out[0]["logp"][0, s : s + len(q) - 1] for s, q in zip(starts, seqs)] if out else []

    model.zero_grad(set_to_none=True)
    alone = []
    for q in seqs:
        ids1, pos1, labels1 = common.alone(q)
        mask1 = torch.ones(1, len(q))
        mask1[0, -1] = 0.0
        out = run(model, [(ids1, pos1, labels1, None, mask1)])
        if out:
            alone.append(out[0]["logp"][0, :-1])
    common.finalize_grads(model)
    return packed, alone, grads_packed, common.full_grads(model)


def main():
    cfg = common.tiny_config()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, common.VOCAB, (2, 20), generator=g)
    seqs = common.sequences((9, 4, 37, 6, 2, 21, 5), seed=2)  # ragged, long-tailed

    # Single stage reference (world of 2 = DP 2: both ranks compute the same).
    initialize_parallel(tp=1, pp=1, seed=SEED)
    model = build_gpt_model(cfg, calculate_per_token_loss=True)
    full = common.full_params(model)
    ref_loss = run(model, [plain_batch(ids)])[0]["loss"]
    ref_grads = common.full_grads(model)
    ref_packed, _, ref_packed_grads, _ = packing_case(model, seqs, 4)
    destroy_parallel(world=False)

    initialize_parallel(tp=1, pp=2, seed=SEED)
    last = parallel_state.is_pipeline_last_stage()
    model = build_gpt_model(cfg, calculate_per_token_loss=True)
    assert len(model.decoder.layers) == 2
    common.load_full(model, full)
    out = run(model, [plain_batch(ids)])
    common.finalize_grads(model)
    grad_err = common.max_diff(common.shard(model, ref_grads), common.full_grads(model))
    loss_err = abs(out[0]["loss"].item() - ref_loss.item()) if last else 0.0
    common.log(f"PP=2 vs PP=1: loss err {loss_err:.2e}, grad err {grad_err:.2e}")
    assert loss_err < TOL * abs(ref_loss.item()) and grad_err < TOL, (loss_err, grad_err)

    for multiple in (4, 1):
        packed, alone, grads_packed, grads_alone = packing_case(model, seqs, multiple)
        errs = dict(
            logp=max([(a - b).abs().max().item() for a, b in zip(packed, alone)], default=0.0),
            logp_vs_pp1=max([(a - b).abs().max().item() for a, b in zip(packed, ref_packed)], default=0.0),
            grad=common.max_diff(grads_packed, grads_alone),
            grad_vs_pp1=common.max_diff(grads_packed, common.shard(model, ref_packed_grads)),
        )
        print(
            f"rank {torch.distributed.get_rank()} packing at PP=2, pad_multiple {multiple}:",
            {k: f"{v:.2e}" for k, v in errs.items()},
            flush=True,
        )
        assert all(v < TOL for v in errs.values()), errs
    destroy_parallel(world=False)

    # Training at PP=2 (untied embeddings: tied ones would need finalize_model_grads to
    # all-reduce the embedding gradient between the first and last stage).
    initialize_parallel(tp=1, pp=2, seed=SEED)
    model = build_gpt_model(common.tiny_config(tie_word_embeddings=False))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    micro_batches = [plain_batch(ids[:1]), plain_batch(ids[1:])]
    losses = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        out = run(model, micro_batches)
        opt.step()
        losses.append(sum(o["loss"].item() for o in out) / 38)  # 38 = tokens with a label
    if last:
        print(f"PP=2 training losses: {[round(x, 4) for x in losses]}", flush=True)
        assert losses[-1] < 0.9 * losses[0], losses
    destroy_parallel()
    common.log("OK")


if __name__ == "__main__":
    main()
