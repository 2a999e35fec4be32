"""Routing replay (rollout.routing_replay, R3: arXiv 2510.11370): every MoE router of a Megatron
forward routes each token to the experts vLLM routed it to when it sampled the completion.

Megatron-Core 0.16's routers replay given top-k indices (transformer/moe/router_replay.py, on with
TransformerConfig.moe_enable_routing_replay): under REPLAY_FORWARD a router takes its target
indices instead of its own top-k and gathers its scores there (with norm_topk_prob, the softmax
over those k logits: the renormalised weights vLLM and transformers compute). This module gives
each router of one model its rows of the micro-batch's `routed_experts` ([rows, T, layers, k],
algorithms/packing.py) before each forward:
  * the layer: a router's layer_number (global, 1-based) picks vLLM's layer column, so a pipeline
    stage replays its own layers;
  * the tokens: in the order the router sees them, [T, rows] flattened (Megatron's [s, b] layout);
    under sequence parallelism this TP rank's share of T.
Recomputation (parallel.recompute) runs the router again in backward; at PP=1 that happens right
after the micro-batch's forward, while its targets are still set, so REPLAY_FORWARD replays there
too. With PP > 1 several micro-batches are in flight and recompute would read the latest one's
targets (Megatron's REPLAY_BACKWARD queue would need switching inside the schedule): refused.

Megatron keeps one global list of every router ever built (policy and reference alike); this
module addresses one model's routers itself and leaves that list unused.

`RoutingAgreement` also counts, for every (token, MoE layer), whether the router's own top-k set
(from its logits, whatever was replayed) equals vLLM's: moe/routing_agreement.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The model's top-k routers in module order (this stage's MoE layers)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def check_layout(pp_size: int, recompute: str) -> None:
    if pp_size > 1 and recompute != "none":
        raise ValueError(
            "rollout.routing_replay with parallel.recompute="
            f"{recompute} at pipeline size {pp_size}: the recomputed routers would replay another "
            "micro-batch's experts; set parallel.recompute=none or pipeline size 1"
        )


def token_rows(per_position: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[rows, T, ...] -> [tokens, ...] in the order this rank's routers see the tokens: T-major
    ([s, b] flattened), this TP rank's share of T under sequence parallelism."""
    r = per_position.transpose(0, 1)  # [T, rows, ...]
    if sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        if r.shape[0] % tp:
            raise ValueError(f"routed_experts: {r.shape[0]} positions do not split over {tp} sequence-parallel ranks")
        share = r.shape[0] // tp
        r = r[rank * share : (rank + 1) * share]
    return r.reshape(-1, *r.shape[2:])


def set_replay(model_routers: list[TopKRouter], routed_experts: torch.Tensor | None, sequence_parallel: bool) -> None:
    """Before a forward: every router replays its layer's column of the micro-batch's routing."""
    if routed_experts is None:
        raise ValueError(
            "rollout.routing_replay: this micro-batch carries no routed experts (ThdBatch.routed_experts); "
            "every completion needs vLLM's"
        )
    rows = token_rows(routed_experts, sequence_parallel).long()
    for router in model_routers:
        column = router.layer_number - 1
        if not 0 <= column < rows.shape[1]:
            raise ValueError(
                f"routed_experts has {rows.shape[1]} layers; MoE layer {router.layer_number} has no column"
            )
        replay = router.router_replay
        replay.clear_indices()  # the backward queue too: REPLAY_FORWARD never pops it
        replay.set_target_indices(rows[:, column].to(router.weight.device))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_replay(model_routers: list[TopKRouter]) -> None:
    for router in model_routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


def forwarded_positions(seq_index: torch.Tensor) -> torch.Tensor:
    """[rows, T] bool: the real positions but each sequence's last, whose token vLLM sampled and
    never forwarded (its routing is a filler, algorithms/packing.sample_routing)."""
    following = torch.cat([seq_index[:, 1:], torch.full_like(seq_index[:, :1], -1)], dim=1)
    return (seq_index >= 0) & (following == seq_index)


class RoutingAgreement:
    """Sums, over forwards, the (forwarded token, MoE layer) pairs whose router's own top-k set (from its
    logits, whatever it replays) equals the micro-batch's routed_experts' set, and the pairs
    counted: moe/routing_agreement = agree / count, what the agreement is without replay."""

    def __init__(self, model_routers: list[TopKRouter]):
        self.routers = model_routers
        self.agree = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)
        self._target = None  # ([tokens, layers, k], [tokens] bool real), the current micro-batch's

    def set_target(self, batch, sequence_parallel: bool) -> None:
        """The micro-batch's routed experts and real tokens, in its routers' token order."""
        self._target = (
            token_rows(batch.routed_experts, sequence_parallel).long(),
            token_rows(forwarded_positions(batch.seq_index), sequence_parallel),
        )

    @contextlib.contextmanager
    def counting(self):
        hooks = [r.register_forward_hook(self._count) for r in self.routers]
        try:
            yield self
        finally:
            for h in hooks:
                h.remove()
            self._target = None

    def _count(self, router, args, output) -> None:
        if self._target is None:
            return
        target, real = self._target
        with torch.no_grad():
            logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)
            own = torch.topk(logits.float(), router.topk, dim=-1).indices.sort(-1).values
            want = target[:, router.layer_number - 1].to(own.device).sort(-1).values
            real = real.to(own.device)
            self.agree += ((own == want).all(-1) & real).double().sum().cpu()
            self.count += real.double().sum().cpu()

    def value(self) -> float:
        return float(self.agree / self.count) if self.count > 0 else float("nan")
