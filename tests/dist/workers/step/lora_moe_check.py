"""Worker: LoRA on a Qwen3 MoE's experts (model.lora.experts=true, megatron/lora.py) against an
independent reference.

    python lora_moe_check.py                                # EP=1, one process
    torchrun --nproc_per_node 2 lora_moe_check.py --ep 2    # EP=2, dense DP=2 (the world)

The tiny random MoE of tests/tiny_models.py (8 experts, top-2, layers 0, 2, 3; layer 1 dense) gets
random adapters (A and B) on every module of model.lora's four roles: q/k/v/o everywhere, the dense
layer's gate/up/down, and each expert's gate/up/down (`model.layers.L.mlp.experts.E.gate_proj`, the
names vLLM and PEFT use). The reference is transformers' model with those adapters added by hand
(no PEFT: transformers 5 stores the experts as fused 3D tensors, which PEFT's module LoRA does not
reach): a forward hook adds scale * B (A x) to each adapted nn.Linear, and each expert computes its
gate, up and down projections with its adapters explicitly. Against it, in the Megatron policy:
  * with the adapters at their start (B = 0) the log-probs are the base model's;
  * with the reference's adapters loaded, the log-probs and the DPPO loss's gradient with respect to
    every adapter (experts gathered over EP) equal the reference's (autograd), and the KL reference
    (adapters off) is the base model;
  * a step changes no base weight;
  * negative control: the experts' adapters loaded one expert over (E's into E+1) move the log-probs
    and the gradient far past the tolerances, so the comparison can fail.
Rank 0 prints LORA MOE CHECK PASSED.
"""

import argparse
import copy
import math
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grad_check import MAX_NEW, B, G, make_problem, my_microbatches, reference_grads, seq_logp  # noqa: E402
from lora_check import max_diff, policy_logprobs  # noqa: E402
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel, lora  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
TOL_LOGP, TOL_GRAD = 1e-5, 3e-5  # lora_check.py's: float32's floor against PEFT is 1e-6 .. 1e-5


def random_adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """{HF adapter name: tensor} for every module of the four roles, experts included, A and B random."""
    gen = torch.Generator().manual_seed(seed)
    out = {}

    def pair(name, fan_in, fan_out):
        out[f"{name}.lora_A.weight"] = 0.2 * torch.randn(RANK, fan_in, generator=gen)
        out[f"{name}.lora_B.weight"] = 0.2 * torch.randn(fan_out, RANK, generator=gen)

    for i, layer in enumerate(model.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = getattr(layer.self_attn, proj).weight
            pair(f"model.layers.{i}.self_attn.{proj}", w.shape[1], w.shape[0])
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            for proj in EXPERT_PROJ:
                w = getattr(layer.mlp, proj).weight
                pair(f"model.layers.{i}.mlp.{proj}", w.shape[1], w.shape[0])
            continue
        hidden, inter = experts.hidden_dim, experts.intermediate_dim
        for e in range(experts.num_experts):
            for proj, (fan_in, fan_out) in zip(EXPERT_PROJ, ((hidden, inter), (hidden, inter), (inter, hidden))):
                pair(f"model.layers.{i}.mlp.experts.{e}.{proj}", fan_in, fan_out)
    return out


def _lora(x, params, name):
    return SCALE * F.linear(F.linear(x, params[f"{name}.lora_A.weight"]), params[f"{name}.lora_B.weight"])


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, params, prefix):
    """transformers' Qwen3MoeExperts.forward with each expert's adapters applied explicitly."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token_idx, slot = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        x = hidden_states[token_idx]
        name = f"{prefix}.{e}"
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        gate = gate + _lora(x, params, f"{name}.gate_proj")
        up = up + _lora(x, params, f"{name}.up_proj")
        h = self.act_fn(gate) * up
        y = F.linear(h, self.down_proj[e]) + _lora(h, params, f"{name}.down_proj")
        out.index_add_(0, token_idx, y * top_k_weights[token_idx, slot, None])
    return out


def reference_model(base, adapters: dict) -> tuple[torch.nn.Module, dict]:
    """(a copy of `base` with `adapters` added by hand, {HF adapter name: its trainable parameter})."""
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.requires_grad_(False)
    holder = torch.nn.Module()
    params = {}
    for name, t in adapters.items():
        params[name] = torch.nn.Parameter(t.clone())
        holder.register_parameter(name.replace(".", "__"), params[name])
    model.add_module("reference_lora", holder)  # model.zero_grad() reaches them
    modules = {n.rsplit(".lora_", 1)[0] for n in adapters if ".experts." not in n}
    for name in modules:
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: out + _lora(args[0], params, name)
        )
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            prefix = f"model.layers.{i}.mlp.experts"
            forward = lambda self, *a, prefix=prefix: _experts_forward(self, *a, params, prefix)  # noqa: E731
            layer.mlp.experts.forward = types.MethodType(forward, layer.mlp.experts)
    return model, params


def one_expert_over(adapters: dict, num_experts: int) -> dict:
    """The negative control: expert E's adapters under expert E+1's names."""
    out = {}
    for name, t in adapters.items():
        if ".experts." in name:
            head, rest = name.split(".experts.")
            e, tail = rest.split(".", 1)
            name = f"{head}.experts.{(int(e) + 1) % num_experts}.{tail}"
        out[name] = t
    return out


def rel_err(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())[:6]
    num = sum(float((got[n] - ref[n]).double().pow(2).sum()) for n in ref)
    return math.sqrt(num / sum(float(ref[n].double().pow(2).sum()) for n in ref))


def compare(policy, adapters, samples, want, ref_grads, denom, dp_rank, dp_size) -> tuple[float, float, float]:
    """Load `adapters` into the policy: (max |dlogp| to `want`, relative adapter grad error to
    `ref_grads`, |loss| of the update)."""
    policy.adapters.load_hf_tensors(adapters, where="the reference's adapters")
    policy.optimizer.reload_model_params()
    lp_err = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size), want)
    metrics = policy.forward_backward(my_microbatches(samples, 24, dp_rank, dp_size), denom)
    return lp_err, rel_err(policy.hf_adapter_grads(), ref_grads), metrics["loss"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()
    initialize_parallel(1, 1, seed=0, ep=args.ep)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, rank0 = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), dist.get_rank() == 0
    cfg, base = tiny_qwen3_moe_model(0)
    adapters = random_adapters(base, seed=5)
    ref, ref_params = reference_model(base, adapters)
    algo = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    settings = lora.LoraSettings(RANK, ALPHA, experts=True, seed=3)
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-2), algo, with_reference=True, lora=settings)
    policy.load_hf_state_dict(hf_checkpoint_tensors(base))
    trained = [n for n, p in policy.model.module.named_parameters() if p.requires_grad]
    assert trained and all(lora.is_adapter(n) for n in trained), trained[:5]

    samples, lengths, w_q, _ = make_problem(base, 0.5, 0.5, seed=7)
    with torch.no_grad():
        want_base = {s.seq_id: seq_logp(base, torch.as_tensor(s.tokens), s.prompt_len) for s in samples}
        want_lora = {s.seq_id: seq_logp(ref, torch.as_tensor(s.tokens), s.prompt_len) for s in samples}
    start = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size), want_base)
    assert start < TOL_LOGP, f"with B = 0 the LoRA policy is not the base model (max |dlogp| {start:.2e})"
    assert set(policy.hf_adapters()) == set(adapters), sorted(set(policy.hf_adapters()) ^ set(adapters))[:5]
    moved = max_diff(want_lora, want_base)
    assert moved > 1e-2, f"the adapters barely move the log-probs ({moved}): the check would prove nothing"

    denom = losses.full_batch_denominator(
        algo.loss_agg,
        num_prompts=B,
        group_size=G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=MAX_NEW,
    )
    ref_loss, _ = reference_grads(ref, samples, algo, denom)
    # an expert no token was routed to has no gradient: zeros, as the policy's
    ref_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in ref_params.items()}
    expert_grads = [g for n, g in ref_grads.items() if ".experts." in n]
    assert sum(float(g.abs().sum()) > 0 for g in expert_grads) > len(expert_grads) // 2, "few experts got tokens"

    control = one_expert_over(adapters, cfg.num_experts)
    ctl_lp, ctl_grad, _ = compare(policy, control, samples, want_lora, ref_grads, denom, dp_rank, dp_size)
    lp_err, grad_err, loss = compare(policy, adapters, samples, want_lora, ref_grads, denom, dp_rank, dp_size)
    ref_err = max_diff(policy_logprobs(policy, samples, dp_rank, dp_size, reference=True), want_base)
    if rank0:
        print(
            f"ep={args.ep} dp={dp_size}: start |dlogp| {start:.2e}, |dlogp| {lp_err:.2e} (adapters move them "
            f"{moved:.3f}), reference-is-base |dlogp| {ref_err:.2e}, loss {loss:.6f} vs {ref_loss:.6f}, "
            f"relative adapter grad error {grad_err:.2e}; control (experts one over): |dlogp| {ctl_lp:.2e}, "
            f"grad error {ctl_grad:.2e}",
            flush=True,
        )
    assert ctl_lp > 100 * TOL_LOGP and ctl_grad > 100 * TOL_GRAD, "the control did not fail: the check is blind"
    assert lp_err < TOL_LOGP, f"log-probs differ from the reference's: max |dlogp| {lp_err:.2e}"
    assert ref_err < TOL_LOGP, f"the KL reference is not the base model: max |dlogp| {ref_err:.2e}"
    assert abs(loss - ref_loss) <= TOL_LOGP * max(1.0, abs(ref_loss)), (loss, ref_loss)
    assert grad_err < TOL_GRAD, f"relative adapter grad error {grad_err:.2e} against the reference"

    before = policy.hf_state_dict()
    policy.optimizer_step()
    after = policy.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a frozen base weight changed"
    if rank0:
        print("LORA MOE CHECK PASSED")
    destroy_parallel()


if __name__ == "__main__":
    main()
