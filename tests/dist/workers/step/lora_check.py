"""Worker: the LoRA policy (megatron/lora.py) equals HF PEFT on the same weights, for a layout.

Run as `torchrun --nproc_per_node N lora_check.py --tp T --pp P`. Every rank builds the same tiny
Qwen3 model and a PEFT LoRA model on it (every module of model.lora's four roles, random A and B),
loads both into a Megatron policy with model.lora, and checks, against PEFT as the independent
reference:
  * with the adapters at their start (B = 0) the policy's log-probs are the base model's;
  * with PEFT's adapters loaded, the log-probs and the DPPO loss's gradient with respect to every
    adapter (the PEFT model's lora_A / lora_B grads) are PEFT's;
  * the base is frozen: no gradient, no optimizer state; a step moves the adapters and nothing else;
  * the KL reference (the adapters off) is the base model.
--negative-control alpha: the policy's alpha is twice PEFT's (must FAIL); tp-sum: the column-parallel
adapters' A gradient is not summed over TP (must FAIL at TP=2).
"""

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grad_check import MAX_NEW, VOCAB, B, G, hf_model, make_problem, my_microbatches, reference_grads, seq_logp

from megatron_dppo.algorithms import losses
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel, lora
from megatron_dppo.megatron.policy import MegatronPolicy

RANK, ALPHA = 4, 8.0
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(base, seed: int):
    """PEFT's LoRA on a copy of `base`, every lora_A and lora_B drawn at random (B = 0 would test nothing)."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=MODULES)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def hf_adapter_name(peft_name: str) -> str:
    """PEFT's parameter name -> megatron/lora.py's HF name (no base_model.model. prefix, no adapter name)."""
    return peft_name.removeprefix("base_model.model.").replace(".default", "")


def policy_logprobs(policy, samples, dp_rank, dp_size, reference=False):
    """{seq_id: completion log-probs} of this rank's sequences (last stage), gathered over the world."""
    mbs = my_microbatches(samples, 10_000, dp_rank, dp_size)
    got = policy.compute_logprobs(mbs, reference=reference)
    out = {}
    if got is not None:
        for mb, lp in zip(mbs, got):  # a completion's tokens: its loss positions (no token masks here)
            for i, seq_id in enumerate(mb.seq_ids.tolist()):
                where = (mb.seq_index == i) & (mb.loss_mask > 0)
                out[seq_id] = lp[where.to(lp.device)].detach().float().cpu()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, out)
    return {k: v for p in parts for k, v in p.items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--negative-control", choices=["none", "alpha", "tp-sum"], default="none")
    ap.add_argument("--family", choices=["qwen3", "llama", "qwen2"], default="qwen3")
    args = ap.parse_args()
    initialize_parallel(args.tp, args.pp, seed=0)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rank0 = dist.get_rank() == 0
    if args.family == "qwen3":
        cfg, base = hf_model()
    else:  # Llama 3 (no q/k norm) and Qwen2.5 (q/k/v biases): the same adapters
        from tiny_models import tiny_family_model

        cfg, base = tiny_family_model(args.family, 0, vocab_size=VOCAB, max_position_embeddings=64)
    hf_sd = {k: v.clone() for k, v in base.state_dict().items() if k != "lm_head.weight"}
    ref = peft_model(base, seed=5)
    if args.negative_control == "tp-sum":  # each TP rank keeps its own share of A's gradient
        lora.copy_to_tensor_model_parallel_region = lambda x, group=None: x
    alpha = 2 * ALPHA if args.negative_control == "alpha" else ALPHA
    algo = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    policy = MegatronPolicy(
        cfg, OptimConfig(lr=1e-2), algo, with_reference=True, lora=lora.LoraSettings(RANK, alpha, seed=3)
    )
    policy.load_hf_state_dict(hf_sd)

    # The base is frozen: the optimizer and the gradient buffers hold the adapters only.
    trained = [n for n, p in policy.model.module.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith(lora.CHILD + ".") for n in trained), trained[:5]
    optimized = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])
    assert optimized == sum(p.numel() for p in policy.model.module.parameters() if p.requires_grad)

    # Step 0 (B = 0) is the base model.
    samples, lengths, w_q, _ = make_problem(base, 0.5, 0.5, seed=7)
    with torch.no_grad():
        want_base = {s.seq_id: seq_logp(base, torch.as_tensor(s.tokens), s.prompt_len) for s in samples}
        want_lora = {s.seq_id: seq_logp(ref, torch.as_tensor(s.tokens), s.prompt_len) for s in samples}
    start = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size), want_base)
    assert start < 1e-5, f"with B = 0 the LoRA policy is not the base model (max |dlogp| {start:.2e})"

    # PEFT's adapters: its log-probs, and the reference (adapters off) stays the base.
    full = {hf_adapter_name(n): p.detach().clone() for n, p in ref.named_parameters() if "lora_" in n}
    policy.adapters.load_hf_tensors(full, where="PEFT's model")
    policy.optimizer.reload_model_params()
    got_names = set(policy.hf_adapters())
    assert got_names == set(full), sorted(got_names ^ set(full))[:5]
    lp_err = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size), want_lora)
    ref_err = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size, reference=True), want_base)
    moved = max_diff(want_lora, want_base)
    assert moved > 1e-2, f"PEFT's adapters barely move the log-probs ({moved}): the check would prove nothing"

    # The DPPO loss's gradient with respect to every adapter.
    denom = losses.full_batch_denominator(
        algo.loss_agg,
        num_prompts=B,
        group_size=G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=MAX_NEW,
    )
    ref_loss, ref_grads = reference_grads(ref, samples, algo, denom)
    ref_grads = {hf_adapter_name(k): v for k, v in ref_grads.items()}
    assert set(ref_grads) == set(full)
    metrics = policy.forward_backward(my_microbatches(samples, 24, dp_rank, dp_size), denom)
    got = policy.hf_adapter_grads()
    num = sum(float((got[k] - ref_grads[k]).pow(2).sum()) for k in ref_grads)
    rel = math.sqrt(num / sum(float(g.pow(2).sum()) for g in ref_grads.values()))
    if rank0:
        print(
            f"{args.family} tp={args.tp} pp={args.pp} dp={dp_size}: start |dlogp| {start:.2e}, "
            f"PEFT |dlogp| {lp_err:.2e} "
            f"(adapters move them {moved:.3f}), reference-is-base |dlogp| {ref_err:.2e}, "
            f"loss {metrics['loss']:.6f} vs {ref_loss:.6f}, relative adapter grad error {rel:.2e}"
        )
    assert lp_err < 1e-5, f"log-probs differ from PEFT's: max |dlogp| {lp_err:.2e}"
    assert ref_err < 1e-5, f"the KL reference is not the base model: max |dlogp| {ref_err:.2e}"
    assert abs(metrics["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (metrics["loss"], ref_loss)
    # float32's floor: 1.5e-6 (Qwen3) to 1.4e-5 (Qwen2's perturbed q/k/v biases) at every layout; the
    # negative controls give 0.98 and 1.7
    assert rel < 3e-5, f"relative adapter grad error {rel:.2e} against PEFT"

    # A step moves the adapters and nothing else.
    before = {k: v.clone() for k, v in policy.hf_state_dict().items()}
    adapters_before = policy.hf_adapters()
    policy.optimizer_step()
    after = policy.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a frozen base weight changed"
    changed = sum(not torch.equal(adapters_before[k], v) for k, v in policy.hf_adapters().items())
    assert changed == len(adapters_before), f"only {changed} of {len(adapters_before)} adapters moved"
    if rank0:
        print("LORA CHECK PASSED")
    destroy_parallel()


if __name__ == "__main__":
    main()
