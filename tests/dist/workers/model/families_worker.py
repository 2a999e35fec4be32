"""torchrun --nproc_per_node 2 tests/dist/workers/model/families_worker.py

The Llama and Qwen2 families (model/families.py) built by megatron/model.py equal transformers'
LlamaForCausalLM / Qwen2ForCausalLM at tiny random shapes: the log-probs of a packed THD row
(ragged sequences, padding between them) equal each sequence run alone through transformers, and
the gradients of their sum equal transformers' gradients (fp32, 1e-5 of the largest), at TP=1
(both ranks alike), TP=2 and PP=2 (through Megatron's pipeline schedule), from the same HF
weights mapped by model/qwen3.py (hf_to_megatron, shard_for_rank). Variants: Llama tied with
llama3 RoPE at low/high_freq_factor and an original context that Megatron-Core's own
RotaryEmbedding(rope_scaling=True) does not reproduce, Llama untied (default RoPE), Qwen2 tied
and untied (q/k/v biases, perturbed away from HF's zeros). Each rank's parameter count equals
what `megatron-dppo plan` counts for it (plan.stage_params)."""

import os
import sys

import megatron_dppo.megatron  # noqa: F401  (before megatron.core: imports it without TorchInductor on CPU)

# isort: split
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import common  # noqa: E402
from tiny_models import LLAMA3_ROPE, hf_checkpoint_tensors, hf_reference, tiny_family_model  # noqa: E402

from megatron_dppo.algorithms.packing import Sample, build_thd_batch  # noqa: E402
from megatron_dppo.jobs import plan  # noqa: E402
from megatron_dppo.megatron import build_gpt_model, destroy_parallel, initialize_parallel, token_logprobs  # noqa: E402
from megatron_dppo.megatron.attention import packed_seq_params  # noqa: E402
from megatron_dppo.model import qwen3  # noqa: E402
from megatron_dppo.model.arch import Arch  # noqa: E402

TOL = 1e-5
LENGTHS = (7, 41, 3, 12, 23)  # positions past llama3's original context of 64 in the packed row
VARIANTS = {
    "llama tied, llama3 RoPE": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama untied": ("llama", dict(tie_word_embeddings=False)),
    "qwen2 tied": ("qwen2", {}),
    "qwen2 untied": ("qwen2", dict(tie_word_embeddings=False)),
}
LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp)


def megatron_run(model, seqs):
    """One packed THD row (padding to a multiple of 4 between sequences) through the pipeline
    schedule -> (per-sequence log-probs on the last stage, else []), {local name: grad} of their sum."""
    batch = build_thd_batch([Sample(tokens=s.tolist(), prompt_len=1) for s in seqs], pad_multiple=4)
    starts = batch.cu_seqlens_padded.tolist()
    mask = torch.zeros(batch.labels.shape)
    for a, s in zip(starts, seqs):
        mask[0, a : a + len(s) - 1] = 1.0

    def forward_step(data_iterator, model):
        next(data_iterator)
        logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=packed_seq_params(batch))

        def loss_func(logits):
            logp = token_logprobs(logits, batch.labels, vocab_size=common.VOCAB)
            loss = (logp * mask).sum()  # the schedule backpropagates it: the gradient of the sum
            return loss, {"logp": logp.detach()}

        return logits, loss_func

    model.zero_grad(set_to_none=True)
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=batch.tokens.size(1),
        micro_batch_size=1,
    )
    common.finalize_grads(model)
    logp = [out[0]["logp"][0, a : a + len(s) - 1] for a, s in zip(starts, seqs)] if out else []
    return logp, {n: p.grad for n, p in model.named_parameters()}


def check(what, cfg, hf, seqs, ref_logp, ref_grads, tp, pp):
    initialize_parallel(tp=tp, pp=pp, seed=0)
    ps = parallel_state
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    model = build_gpt_model(cfg)
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=model.vocab_size)
    stage = "only" if pp == 1 else ("first" if pp_rank == 0 else "last")
    counted = plan.stage_params(Arch.from_hf(cfg.to_dict()), tp, pp)[stage]
    assert counted == sum(p.numel() for p in model.parameters()), (what, tp, pp, counted)

    def mine(hf_named):
        return qwen3.shard_for_rank(qwen3.hf_to_megatron(hf_named, layout), layout, tp_rank, tp, pp_rank, pp)

    weights = mine(hf_checkpoint_tensors(hf))
    names = dict(model.named_parameters()).keys()
    assert weights.keys() == names, (what, set(weights) ^ set(names))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    logp, grads = megatron_run(model, seqs)
    ref = mine(ref_grads)
    lerr = max(((a - b).abs().max().item() for a, b in zip(logp, ref_logp)), default=0.0)
    gerr = max((g - ref[n]).abs().max().item() for n, g in grads.items())
    gmax = max(r.abs().max().item() for r in ref.values())
    print(
        f"[rank {dist.get_rank()}] {what} TP={tp} PP={pp}: {sum(map(len, logp))} tokens, max |logp diff| "
        f"{lerr:.2e}, max |grad diff| / max |grad| {gerr / gmax:.2e}",
        flush=True,
    )
    assert lerr < TOL and gerr / gmax < TOL, (what, tp, pp, lerr, gerr / gmax)
    destroy_parallel(world=False)


def main():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, common.VOCAB, (n,), generator=g) for n in LENGTHS]
    for what, (family, overrides) in VARIANTS.items():
        cfg, hf = tiny_family_model(family, 0, **overrides)
        ref_logp, ref_grads = hf_reference(hf, seqs)
        for tp, pp in LAYOUTS:
            check(what, cfg, hf, seqs, ref_logp, ref_grads, tp, pp)
    dist.barrier()  # every rank past its last collective before gloo is torn down (a teardown abort seen in CI)
    dist.destroy_process_group()
    common.log("OK")


if __name__ == "__main__":
    main()
