"""`megatron-dppo plan`'s LoRA arithmetic (model.lora, rank > 0): the adapters' parameters per
rank, their activations and the weight sync they make, from the model's shapes alone.

Each targeted HF module gets its own pair, as PEFT builds it: A [r, in], B [out, r]. Roles:

  qkv    q_proj [h -> nq d], k_proj, v_proj [h -> nkv d]   column-parallel
  proj   o_proj [nq d -> h]                                  row-parallel
  fc1    gate_proj, up_proj [h -> f]                         column-parallel
  fc2    down_proj [f -> h]                                  row-parallel

On an MoE layer fc1 / fc2 adapt the routed experts (width f_e, one set per expert) and only with
model.lora.experts (Qwen3-MoE has no dense MLP there); the router is never adapted. Under tensor
parallelism a column-parallel linear's B is split over TP (its rows) and A is replicated; a
row-parallel linear's A is split (its columns) and B is replicated. An expert's linears split the
same way over expert TP; expert parallelism gives each rank num_experts / ep experts; pipeline
parallelism splits by layers. The base weights are frozen (megatron/lora.py): only these
parameters have gradients and optimizer state, and the weight sync sends only them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_dppo.model.arch import Arch

# role -> the HF modules it adapts: (name, parallel kind, in, out) with in / out as names of Arch
# shapes ("q", "kv": the query / KV heads' widths; "ffn": the MLP's width, the expert's on an MoE layer)
ROLE_MODULES = {
    "qkv": (("q_proj", "column", "h", "q"), ("k_proj", "column", "h", "kv"), ("v_proj", "column", "h", "kv")),
    "proj": (("o_proj", "row", "q", "h"),),
    "fc1": (("gate_proj", "column", "h", "ffn"), ("up_proj", "column", "h", "ffn")),
    "fc2": (("down_proj", "row", "ffn", "h"),),
}
ATTENTION_ROLES, MLP_ROLES = ("qkv", "proj"), ("fc1", "fc2")
# vLLM 0.32's max_lora_rank choices (vllm.config.lora.MaxLoRARanks): its LoRA slot is sized to the
# smallest that holds r (rollout/vllm_engine.lora_engine_kwargs); plan imports no vLLM.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Adapter:
    """One adapted HF module's shapes: A [rank, fan_in], B [fan_out, rank]."""

    name: str
    role: str  # the Megatron linear it sits on (model.lora.targets): qkv, proj, fc1, fc2
    kind: str  # "column" | "row": how its linear splits over (expert) TP
    fan_in: int
    fan_out: int
    expert: bool  # one of a routed expert's (times num_experts / ep on a rank)

    def params(self, rank: int, split: int = 1) -> int:
        """A + B on one rank of a TP (expert TP) group of `split`: column splits B, row splits A."""
        a, b = rank * self.fan_in, self.fan_out * rank
        return a + b // split if self.kind == "column" else a // split + b

    def replicated(self, rank: int) -> int:
        """The half every rank of the TP group holds whole (column: A, row: B)."""
        return rank * self.fan_in if self.kind == "column" else self.fan_out * rank


def layer_adapters(arch: Arch, lora, sparse: bool) -> tuple[Adapter, ...]:
    """The adapters of one decoder layer (dense or sparse) under model.lora's targets."""
    return _layer_adapters(arch, tuple(lora.targets), lora.experts, sparse)


@functools.lru_cache(maxsize=256)  # the layout search plans thousands of layouts of one model
def _layer_adapters(arch: Arch, targets: tuple, experts: bool, sparse: bool) -> tuple[Adapter, ...]:
    widths = {"h": arch.hidden, "q": arch.heads * arch.head_dim, "kv": arch.kv_heads * arch.head_dim}
    widths["ffn"] = arch.moe_ffn if sparse else arch.ffn
    out = []
    for role in targets:
        expert = sparse and role in MLP_ROLES
        if expert and not experts:
            continue  # an MoE layer's MLP is its experts: adapted only with model.lora.experts
        out += [Adapter(n, role, kind, widths[i], widths[o], expert) for n, kind, i, o in ROLE_MODULES[role]]
    return tuple(out)


def adapter_params(arch: Arch, lora, layers, tp: int = 1, ep: int = 1, etp: int = 1) -> dict:
    """Adapter parameters one rank holds for `layers` (dense: the attention's and a dense MLP's,
    sharded over DP by the distributed optimizer; expert: sharded over expert DP). tp = ep = etp =
    1 over every layer: the HF count, what PEFT's get_peft_model makes trainable."""
    sparse = sum(arch.is_sparse(i) for i in layers)
    dense = expert = 0
    for is_sparse, count in ((False, len(layers) - sparse), (True, sparse)):
        for a in layer_adapters(arch, lora, is_sparse) if count else ():
            if a.expert:
                expert += count * (arch.experts // ep) * a.params(lora.rank, etp)
            else:
                dense += count * a.params(lora.rank, tp)
    return {"dense": dense, "expert": expert}


def hf_adapter_params(arch: Arch, lora) -> int:
    """Every adapter parameter of the model: what the weight sync sends each step."""
    n = adapter_params(arch, lora, range(arch.layers))
    return n["dense"] + n["expert"]


def layer_activation_elems(
    arch: Arch, lora, sparse: bool, *, tp: int, sp: bool, etp: int, pbytes: int, imbalance: float
) -> dict:
    """What the adapters of one layer add to plan.layer_activation_elems per token on one rank,
    split into the attention's and the MLP's part (the MLP's is rebuilt with recompute 'mlp' /
    'moe', both with 'full'). As megatron/lora.py computes them:

      r a pair    its A output h, kept by B's linear for B's gradient; whole on every TP rank (a
                  column pair's A is replicated, a row pair's partial A outputs are summed
                  before B). A's own input is the base linear's input, kept already.
      dropout     with model.lora.dropout > 0, once per adapted linear (its pairs share it): the
                  dropped copy of the linear's input (h / s for a column linear, in / t for a row
                  one) and its mask (1 byte an element).

    On an MoE layer each of the k routed copies of a token (etp x as many on an expert-TP rank)
    passes the experts' adapters, times `imbalance` (the busiest expert rank's share over an even
    one, plan.MOE_IMBALANCE), / s with sequence parallel as the experts' own activations."""
    drop = (1 + 1 / pbytes) if lora.dropout > 0 else 0.0
    split = tp if sp else 1
    parts = {"attn": 0.0, "mlp": 0.0}
    dropped_linears = set()
    for a in layer_adapters(arch, lora, sparse):
        dropped = 0.0
        if drop and a.role not in dropped_linears:
            dropped_linears.add(a.role)
            dropped = drop * (
                a.fan_in / (1 if a.expert else split) if a.kind == "column" else a.fan_in / (etp if a.expert else tp)
            )
        elems = lora.rank + dropped
        if a.expert:
            elems *= arch.experts_per_tok * etp * imbalance / split
        parts["mlp" if a.role in MLP_ROLES else "attn"] += elems
    return parts


def vllm_slot_params(arch: Arch, lora, rollout_tp: int) -> int:
    """Parameters of vLLM's one LoRA slot on one rank of an engine of TP rollout_tp (max_loras=1):
    every adapter at max_lora_rank, split over its TP as Megatron's are (its experts over the same
    TP: vLLM's fused MoE without expert parallelism)."""
    slot_rank = min((r for r in VLLM_LORA_RANKS if r >= lora.rank), default=lora.rank)
    n = adapter_params(
        arch, dataclasses.replace(lora, rank=slot_rank), range(arch.layers), tp=rollout_tp, etp=rollout_tp
    )
    return n["dense"] + n["expert"]


def sync_peak_bytes(arch: Arch, lora, pbytes: int, *, pp: int, ep: int) -> dict:
    """plan.sync_peak_bytes when only the adapters move, as MegatronPolicy.hf_adapters sends them
    (megatron/lora.py): each tensor is merged over TP on the GPU (its shards' gather buffer beside
    the merged copy: 2 x the largest tensor) and kept on the CPU; at PP or EP > 1 gather_over_stages
    all-gathers every stage's share over PP, then every EP rank's over EP, as pickled objects, which
    NCCL moves through the GPU: the gather's input and its output (at EP > 1 each EP rank sends the
    attention's adapters again, so ep x those + the experts'). vLLM copies them into its LoRA slot
    one tensor at a time (2 x the largest, cast and copied). A dedicated rollout GPU receives them
    whole ("bucket"). Returns sync_peak_bytes' {"trainer", "vllm", "total", "bucket"} in bytes."""
    n = adapter_params(arch, lora, range(arch.layers))
    dense, expert = n["dense"] * pbytes, n["expert"] * pbytes
    total = dense + expert
    largest = max(
        (
            max(lora.rank * a.fan_in, a.fan_out * lora.rank)
            for sparse in {arch.is_sparse(i) for i in range(arch.layers)}
            for a in layer_adapters(arch, lora, sparse)
        ),
        default=0,
    )
    gathered = 0.0
    if ep > 1:
        gathered = ep * dense + expert + dense + expert / ep  # the EP gather's output and input
    elif pp > 1:
        gathered = total + total / pp
    trainer = gathered + 2 * largest * pbytes
    vllm = 2 * largest * pbytes
    return {"trainer": trainer, "vllm": vllm, "total": trainer + vllm, "bucket": total}


def describe(lora) -> str:
    """'lora r=<r> (...)' or 'full fine-tuning': how the plan names the run."""
    if not lora.rank:
        return "full fine-tuning"
    experts = f", experts {'on' if lora.experts else 'off'}"
    return f"lora r={lora.rank} (alpha {lora.alpha:g}, targets {','.join(lora.targets)}{experts})"
