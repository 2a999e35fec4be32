"""Worker: rollout.routing_replay in Megatron's log-prob and training passes, against transformers
routed the same way.

    python routing_replay_check.py [--recompute R]            # EP=1, one process
    torchrun --nproc_per_node 2 routing_replay_check.py --ep 2
    torchrun --nproc_per_node 2 routing_replay_check.py --pp 2   # layers 0-1 | 2-3: each stage its routers

The tiny random MoE of moe_grad_check.py (8 experts, top-2, layers 0, 2, 3 sparse). Each sample
carries routed experts as vLLM would return them ([tokens, layers, k]): transformers' own top-2
with a fixed 40% of the (token, layer) pairs swapped for another expert pair, so a router left to
itself disagrees there. Then:
1. every Megatron router's routing_map in the pi_old pass, the training forward and (with
   recompute) the backward's recompute is the target routing, token for token;
2. the pi_old log-probs and the DPPO gradient equal transformers' with its gates forced to the
   same experts (weights: the softmax over the k forced logits, norm_topk_prob), and without
   replay they do not (negative control);
3. moe/routing_agreement equals the fraction of (forwarded token, MoE layer) pairs where
   transformers' own top-2 set equals the target's (each sequence's last token excluded);
4. (one process) a bf16 "rollout": transformers in bfloat16 stands in for vLLM (which cannot return
   routed experts on CPU). Its routing replayed in the fp32 policy shrinks the mean |log-prob gap|
   to its log-probs, and the agreement reports the routes bf16 flipped.
Rank 0 prints ROUTING REPLAY CHECK PASSED.
"""

import argparse
import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from grad_check import MAX_NEW, B, G, make_problem, my_microbatches, reference_grads, seq_logp  # noqa: E402
from moe_grad_check import rel_err  # noqa: E402
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.megatron.routing_replay import routers, token_rows  # noqa: E402

TOL = 1e-5
SWAPPED = 0.4


def gates(model):
    return [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]


@torch.no_grad()
def own_routing(model, samples):
    """transformers' own top-k experts per sample: [tokens, layers, k] (arange(k) on dense layers)."""
    k, L = model.config.num_experts_per_tok, model.config.num_hidden_layers
    out, got = [], {}
    hooks = [g.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o[2])) for i, g in gates(model)]
    for s in samples:
        got.clear()
        model(torch.as_tensor(s.tokens)[None])
        r = torch.arange(k).expand(len(s.tokens), L, k).clone()
        for i, idx in got.items():
            r[:, i] = idx
        out.append(r)
    for h in hooks:
        h.remove()
    return out


def swapped(routing, num_experts, seed):
    """The routing with SWAPPED of its (token, MoE layer) pairs set to another expert pair."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in routing:
        r = r.clone()
        for t in range(r.shape[0]):
            for layer in range(r.shape[1]):
                if torch.rand((), generator=g) < SWAPPED:
                    while True:
                        other = torch.randperm(num_experts, generator=g)[: r.shape[2]]
                        if set(other.tolist()) != set(r[t, layer].tolist()):
                            break
                    r[t, layer] = other
        out.append(r)
    return out


@contextlib.contextmanager
def forced(model, routing, agreement=None):
    """transformers routed as `routing` (one [tokens, layers, k] per forward, in order): each gate's
    top-k replaced by the forced experts, weights renormalised over them from its logits.
    agreement: gets, per gate call, whether its own top-k set equals the forced one (all tokens but
    the last)."""
    queue = iter(routing)
    current = {}
    pre = model.register_forward_pre_hook(lambda m, a: current.__setitem__("r", next(queue)))

    def hook(module, args, out, layer):
        logits = out[0]
        idx = current["r"][:, layer].to(logits.device)
        if agreement is not None:
            agreement.append((out[2].sort(-1).values == idx.sort(-1).values).all(-1)[:-1])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
        if module.norm_topk_prob:
            probs = probs / probs.sum(-1, keepdim=True)
        return logits, probs.to(logits.dtype), idx

    hooks = [pre] + [g.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, g in gates(model)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def routing_maps(policy):
    """Every router forward's (layer_number, routing_map) of the policy model, in call order."""
    seen = []
    model_routers = routers(policy.model)
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append((m.layer_number, o[1]))) for r in model_routers]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def check_maps(seen, mbs, per_micro_batch, num_experts, what):
    """Each micro-batch's routers (per_micro_batch calls each) routed exactly its routed_experts."""
    n_layers = len(seen) // (len(mbs) * per_micro_batch)
    assert n_layers and len(seen) == len(mbs) * per_micro_batch * n_layers, (what, len(seen))
    for j, (layer, routing_map) in enumerate(seen):
        mb = mbs[j // (per_micro_batch * n_layers)]
        target = token_rows(mb.routed_experts, False)[:, layer - 1].long()
        want = torch.zeros(target.shape[0], num_experts, dtype=torch.bool).scatter(1, target, True)
        assert torch.equal(routing_map.cpu(), want), f"{what}: layer {layer} routed other experts"


def bf16_rollout(cfg, model, weights, samples, mbs, loss_cfg, args, by_id):
    """Check 4: the gap to a bf16 transformers rollout with and without replaying its routing."""
    bf16 = copy.deepcopy(model).bfloat16()
    with torch.no_grad():
        rollout_logp = [seq_logp(bf16, torch.as_tensor(s.tokens), s.prompt_len).float() for s in samples]
    for mb in mbs:  # the micro-batches' routing := the bf16 model's own, position for position
        k = mb.routed_experts.shape[-1]
        mb.routed_experts = torch.arange(k, dtype=mb.routed_experts.dtype).expand_as(mb.routed_experts).clone()
    routing = own_routing(bf16, samples)
    for mb in mbs:
        for j, sid in enumerate(mb.seq_ids.tolist()):
            at = (mb.seq_index[0] == j).nonzero().flatten()
            mb.routed_experts[0, at] = routing[by_id[sid]].to(torch.int32)
    gap, agreement = {}, None
    for replay in (False, True):
        policy = MegatronPolicy(cfg, OptimConfig(lr=1e-3), loss_cfg, recompute=args.recompute, routing_replay=replay)
        policy.load_hf_state_dict(weights)
        diffs = []
        for mb, lp in zip(mbs, policy.compute_logprobs(mbs)):
            for j, sid in enumerate(mb.seq_ids.tolist()):
                at = (mb.seq_index[0] == j) & (mb.loss_mask[0] > 0)
                diffs.append((lp[0][at] - rollout_logp[by_id[sid]]).abs())
        gap[replay] = float(torch.cat(diffs).mean())
        if replay:
            agreement = policy.forward_backward(mbs, 100.0)["routing_agreement"]
    assert gap[True] < gap[False] and agreement < 1.0, (gap, agreement)
    print(
        f"ok bf16 rollout (transformers): mean |log-prob gap| {gap[False]:.3e} without replay, "
        f"{gap[True]:.3e} with; routing_agreement {agreement:.4f}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    args = ap.parse_args()
    initialize_parallel(1, args.pp, seed=0, ep=args.ep)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, rank0 = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), dist.get_rank() == 0
    cfg, model = tiny_qwen3_moe_model(0)
    E = cfg.num_experts
    weights = hf_checkpoint_tensors(model)
    loss_cfg = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    samples, lengths, w_q, _ = make_problem(model, 0.0, 0.0, seed=7)
    denom = losses.full_batch_denominator(
        loss_cfg.loss_agg, num_prompts=B, group_size=G, completion_lengths=lengths, prompt_weight=w_q,
        max_response_length=MAX_NEW,
    )  # fmt: skip
    own = own_routing(model, samples)
    target = swapped(own, E, seed=3)
    for s, r in zip(samples, target):
        s.routed_experts = r.to(torch.int32)

    agreement = []  # 3's reference: each gate's own top-k set (upstream layers forced) vs the target's
    with forced(model, target, agreement):  # and 2's references
        ref_logp = [seq_logp(model, torch.as_tensor(s.tokens), s.prompt_len).detach() for s in samples]
    want_agreement = float(torch.cat(agreement).double().mean())
    with forced(model, target):
        reference_grads(model, samples, loss_cfg, denom)
    ref = hf_checkpoint_tensors(model, grads=True)

    policies = {}
    for replay in (True, False):
        p = MegatronPolicy(cfg, OptimConfig(lr=1e-3), loss_cfg, recompute=args.recompute, routing_replay=replay)
        p.load_hf_state_dict(weights)
        policies[replay] = p
    mbs = my_microbatches(samples, 24, dp_rank, dp_size)
    mine = [int(i) for mb in mbs for i in mb.seq_ids]  # make_problem's seq_id -> its sample
    by_id = {s.seq_id: k for k, s in enumerate(samples)}

    gaps = {}
    for replay, policy in policies.items():
        with routing_maps(policy) as seen:
            logps = policy.compute_logprobs(mbs)
        if replay:
            check_maps(seen, mbs, 1, E, "pi_old pass")
        gap = 0.0
        for mb, lp in zip(mbs, logps or []):  # None before the last pipeline stage
            for j, sid in enumerate(mb.seq_ids.tolist()):
                at = (mb.seq_index[0] == j) & (mb.loss_mask[0] > 0)
                gap = max(gap, float((lp[0][at] - ref_logp[by_id[sid]]).abs().max()))
        gaps[replay] = gap
    if ps.is_pipeline_last_stage():
        assert gaps[True] < TOL < gaps[False], gaps

    grads = {}
    for replay, policy in policies.items():
        with routing_maps(policy) as seen:
            metrics = policy.forward_backward(mbs, denom)
        grads[replay] = rel_err(policy.hf_grads(), ref)
        if replay:
            check_maps(seen, mbs, 2 if args.recompute != "none" else 1, E, "train pass")
            got_agreement = metrics["routing_agreement"]
        else:
            assert "routing_agreement" not in metrics
    assert grads[True] < TOL < grads[False], grads
    assert abs(got_agreement - want_agreement) < 1e-12, (got_agreement, want_agreement)
    assert 0.4 < want_agreement < 0.7, want_agreement  # ~ (1 - SWAPPED)^... per pair: the check can fail
    if ps.is_pipeline_last_stage() and dp_rank == 0:  # the stage with the log-probs
        print(
            f"ok ep={args.ep} pp={args.pp} recompute={args.recompute} sequences={len(mine)}: log-prob gap vs forced "
            f"transformers {gaps[True]:.2e} (no replay {gaps[False]:.2e}); rel.grad.err {grads[True]:.2e} "
            f"(no replay {grads[False]:.2e}); routing_agreement {got_agreement:.4f} (reference {want_agreement:.4f})"
        )
    if dp_size == 1 and args.pp == 1:
        bf16_rollout(cfg, model, weights, samples, mbs, loss_cfg, args, by_id)
    dist.barrier()  # every rank's checks done
    if rank0:
        print("ROUTING REPLAY CHECK PASSED")
    destroy_parallel()


if __name__ == "__main__":
    main()
