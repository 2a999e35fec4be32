"""`megatron-dppo plan`: will this run fit, per GPU, before we ask a cluster for it?

The plan is arithmetic over the run config and the model's config.json (no Megatron, no vLLM,
no GPU: it runs anywhere in about a second). docs/scaling.md derives every term;
in short, for the worst pipeline stage of one GPU:

  weights      params (model.dtype) of this TP/PP shard, Megatron's padded vocabulary included;
               for a mixture of experts also this EP rank's experts (num_experts / ep of each
               sparse layer, each split over etp)
  gradients    fp32 main_grad buffer (Megatron DDP, grad_reduce_in_fp32) = 4 B/param
  optimizer    Adam m, v (+ fp32 master copy for bf16 params) = 12 B/param (8 for fp32),
               divided by DP under the distributed optimizer (an expert's by the expert-DP size,
               GPUs / (ep x etp x pp))
  reference    a second copy of the weights when algorithm.kl_coef > 0 (none with LoRA: the base
               model with the adapters off is the reference)
  activations  per layer per token for a GQA SwiGLU layer (layer_activation_elems) x layers
               on the stage x micro-batch tokens x micro-batches in flight (pp on the first
               1F1B stage). parallel.recompute: selective = Megatron recompute_modules
               ["core_attn", "mlp"]; full = granularity full, method uniform, 1 layer per chunk
  MoE layers   kept per token: the k routed copies of the token and the expert MLP's
               intermediates, times an imbalance factor (the busiest expert rank gets more than its
               share), and the router's fp32 logits and probabilities; all-to-all: one layer's
               dispatch send and receive buffers in flight
  logits       micro-batch tokens x padded vocab / TP x 2 x dtype bytes (the logits and their
               gradient) + the log-prob pass's fp32 blocks (5 x 128 MiB at most), last stage
  vLLM         colocated: asleep (KV freed, weights offloaded) while Megatron trains; while it
               generates it owns gpu_memory_utilization x GPU: its weights, runtime and the KV
               cache that is left
  overhead     CUDA context, NCCL and cuBLAS workspaces (fixed) + allocator fragmentation
  LoRA         model.lora.rank > 0 (jobs/plan_lora.py): the base weights stay (model.dtype) but are
               frozen, so gradients and optimizer count only the adapters' parameters (this
               rank's share under TP / PP / EP); activations add the adapters' r-wide outputs; the
               weight sync moves only the adapters, and vLLM holds them beside its base weights

Two phases are checked: train (Megatron peak, vLLM asleep) and generate (Megatron's resident
state + vLLM awake). With dedicated rollout ranks (parallel.rollout_ranks > 0) a training GPU has
train and send (resident state + the sync's sending side, no vLLM) and a rollout GPU vLLM's share
of the whole GPU + the weights arriving (rollout_gpu_bytes); given measured rates, plan_step
adds the step time colocated and dedicated. A layout that does not fit is refused with the knobs that would fix it.
The config is checked first by the trainer's own rules (config.load_config's validation and
config.check_layout with world = nodes x gpus_per_node), so `plan` accepts what `train` accepts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
from pathlib import Path

from megatron_dppo.config import apply_overrides, check_layout, layout_choices, load_config, resolve_gpu_settings
from megatron_dppo.jobs import plan_lora
from megatron_dppo.jobs.plan_step import StepInputs, check_inputs, format_step_times, step_times
from megatron_dppo.model.arch import Arch
from megatron_dppo.model.vocab import padded_vocab_size

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]

# Estimates, not measurements (docs/scaling.md says where they come from).
CUDA_OVERHEAD = 2 * GiB  # CUDA context (~0.5 GiB), NCCL buffers, cuBLAS/TE workspaces
FRAGMENTATION = 0.10  # caching-allocator slack on the training peak (variable-size packs)
VLLM_RUNTIME = 2 * GiB  # vLLM's profiled activation peak + CUDA graphs, inside its share
SYNC_BUCKET = 1 << 30  # the weight sync's bucket (MegatronPolicy.hf_weight_buckets' default)
# The loss's log-probs run over blocks of positions (megatron/logprobs.py): LOGPROB_BLOCK fp32
# elements a block (its CHUNK_ELEMENTS), at most LOGPROB_BLOCKS blocks alive (the entropy's
# temporaries beside the scaled block).
LOGPROB_BLOCK, LOGPROB_BLOCKS = 1 << 25, 5
MOE_IMBALANCE = 1.5  # tokens the busiest expert rank receives / its even share (no token dropping)


def _stage_layers(arch: Arch, pp: int) -> dict:
    per = arch.layers // pp
    if pp == 1:
        return {"only": range(arch.layers)}
    return {"first": range(per), "last": range(arch.layers - per, arch.layers)}


def stage_params(arch: Arch, tp: int, pp: int) -> dict:
    """Parameters held by one GPU of the first and of the last pipeline stage, experts apart
    (stage_expert_params)."""
    emb = padded_vocab_size(arch.vocab, tp) * arch.hidden // tp
    body = {k: sum(arch.layer_params(tp, arch.is_sparse(i)) for i in r) for k, r in _stage_layers(arch, pp).items()}
    if pp == 1:
        only = body["only"] + emb + arch.hidden + (0 if arch.tied else emb)
        return {"only": only}
    # A tied model's last stage keeps its own copy of the embedding as the output layer.
    return {"first": body["first"] + emb, "last": body["last"] + arch.hidden + emb}


def stage_expert_params(arch: Arch, ep: int, etp: int, pp: int) -> dict:
    """Expert parameters held by one GPU of each pipeline stage (0 for a dense model)."""
    return {
        k: sum(arch.is_sparse(i) for i in r) * arch.expert_params(ep, etp) for k, r in _stage_layers(arch, pp).items()
    }


DEFAULT_RECOMPUTE_MODULES = ("core_attn", "mlp")  # config.SELECTIVE_RECOMPUTE_MODULES


def sync_peak_bytes(arch: Arch, pbytes: int, *, tp: int, ep: int, etp: int, rollout_tp: int, bucket: int = SYNC_BUCKET):
    """The weight sync's peak on one GPU, above the resident state (megatron/weights.py's
    hf_weight_buckets into RolloutEngine.load_weights; tests/dist/workers/step/sync_peak_check.py measures
    the trainer's side against this on CPU):

      trainer   max(bucket, largest unit) + 2 x the largest copy. A unit (one decoder layer with
                all its experts, the head, the embedding) is gathered whole, TP-merged, over every
                PP stage; a bucket holds whole units up to `bucket` (a larger unit alone), the
                previous one let go before the next is gathered. A copy is what one tensor's
                conversion adds beside the unit: split_qkv's q/k/v while the fused QKV is alive;
                at TP > 1 a row / fc1 tensor's merged copy beside its gather buffer; at EP > 1 one
                linear's local experts stacked for their one gather (at expert-TP > 1 twice). Two
                of them: the process group keeps the previous collective's input referenced until
                the next one completes.
      vLLM      its layer-wise reload holds one layer's weights on a vLLM rank (1 / rollout_tp of
                them) materialized and once more while they are processed into the kernel layout.
    Returns {"trainer", "vllm", "total", "bucket"} in bytes; "bucket" is the largest bucket in
    flight, max(bucket, largest unit), what a dedicated rollout GPU receives at once."""
    h, d, nq, nkv = arch.hidden, arch.head_dim, arch.heads, arch.kv_heads
    vocab = padded_vocab_size(arch.vocab, tp) * h
    layers = [
        arch.layer_params(1, arch.is_sparse(i)) + (arch.expert_params() if arch.is_sparse(i) else 0)
        for i in range(arch.layers)
    ]
    units = [vocab, *layers, h + (0 if arch.tied else vocab)]
    copies = [(nq + 2 * nkv) * d * h]  # split_qkv
    if tp > 1:  # o_proj, and a dense layer's fc1 [gate; up] and fc2
        dense = any(not arch.is_sparse(i) for i in range(arch.layers))
        copies += [nq * d * h] + ([2 * arch.ffn * h, arch.ffn * h] if dense else [])
    if arch.experts and (ep > 1 or etp > 1):
        copies.append(arch.experts // ep * 2 * arch.moe_ffn * h * (2 if etp > 1 else 1))
    in_flight = max(bucket, max(units) * pbytes)
    trainer = in_flight + 2 * max(copies) * pbytes
    vllm = 2 * max(layers) * pbytes / rollout_tp
    return {"trainer": trainer, "vllm": vllm, "total": trainer + vllm, "bucket": in_flight}


def layer_activation_elems(
    arch: Arch, tp: int, sp: bool, recompute: str, modules: tuple = DEFAULT_RECOMPUTE_MODULES
) -> dict:
    """Elements one layer keeps for backward per token on one TP rank (fused GPU path: flash
    attention keeps no s x s scores, SwiGLU fused). Returns {'kept': per layer, 'work': the
    extra a recomputed layer rebuilds during its own backward (held for one layer only)}.

      replicated over TP (divided by TP only with sequence parallel):
        4h      inputs of the two RMSNorms and of the two column-parallel linears (QKV, fc1)
      split over TP:
        (nq + 2 nkv) d   QKV output (q/k-norm inputs are views of it, so all of it stays)
        (nq + nkv) d     q and k after qk-norm + RoPE, as flash attention saves them
        nq d             attention output = out-proj input
        2f + f           SwiGLU input [gate; up] and fc2 input
    """
    h, d, f, nq, nkv = arch.hidden, arch.head_dim, arch.ffn, arch.heads, arch.kv_heads
    rep = 4 * h / (tp if sp else 1)
    attn = (3 * nq + 3 * nkv) * d / tp
    mlp = 3 * f / tp
    full = rep + attn + mlp
    if recompute == "none":
        return {"kept": full, "work": 0.0}
    if recompute == "selective":
        # "mlp" rebuilds the MLP; "core_attn" saves nothing here: flash attention keeps only q, k, v
        # and its output, which the layer keeps anyway ("layernorm": the TE path's dense norms are
        # fused into the linears, so there is no norm output to drop)
        rebuilt = mlp if "mlp" in modules else 0.0
        return {"kept": full - rebuilt, "work": rebuilt}
    # full: each layer keeps only its input hidden states (sequence-sharded with SP)
    return {"kept": h / (tp if sp else 1), "work": full}


def moe_layer_activation_elems(
    arch: Arch, tp: int, sp: bool, recompute: str, etp: int, pbytes: int, modules: tuple = DEFAULT_RECOMPUTE_MODULES
) -> dict:
    """layer_activation_elems for a sparse (MoE) layer, per token of the micro-batch on one rank.
    Attention and norms as a dense layer's; the MoE MLP keeps, per token routed to k experts:

      k h etp        the k dispatched copies (fc1 input; an expert-TP group gathers its tokens)
      4 k f_e        SwiGLU input [gate; up], its output (the routing weight's backward), fc2 input
      (all x MOE_IMBALANCE: the busiest expert rank receives more than its share)
      2 E fp32       the router's logits and probabilities
    With sequence parallel each TP rank routes its T / tp tokens. `selective` recomputes the experts'
    activation ("moe_act" on the TE path, megatron/policy.py): fc1's output stays, the SwiGLU
    output and fc2's input (2 k f_e) are rebuilt one layer at a time; `full` keeps the layer input."""
    h, d, nq, nkv = arch.hidden, arch.head_dim, arch.heads, arch.kv_heads
    split = tp if sp else 1
    rep = 4 * h / split
    attn = (3 * nq + 3 * nkv) * d / tp
    k = arch.experts_per_tok
    moe = ((k * h * etp + 4 * k * arch.moe_ffn) * MOE_IMBALANCE + 2 * arch.experts * 4 / pbytes) / split
    full = rep + attn + moe
    if recompute == "full":
        return {"kept": h / split, "work": full}
    if recompute == "selective":
        # "moe" rebuilds the whole MoE MLP; "layernorm" the unfused pre-MLP norm's output (h)
        rebuilt = moe if "moe" in modules else 2 * k * arch.moe_ffn * MOE_IMBALANCE / split
        rebuilt += h / split if "layernorm" in modules else 0.0
        return {"kept": full - rebuilt, "work": rebuilt}
    return {"kept": full, "work": 0.0}


def stage_activation_elems(
    arch: Arch,
    layers: range,
    tp: int,
    sp: bool,
    recompute: str,
    etp: int,
    pbytes: int,
    modules: tuple = DEFAULT_RECOMPUTE_MODULES,
    lora=None,
):
    """(kept elements per token summed over a stage's layers, the largest recompute working set);
    with `lora` (model.lora, rank > 0) the adapters' activations too."""
    per = [
        moe_layer_activation_elems(arch, tp, sp, recompute, etp, pbytes, modules)
        if arch.is_sparse(i)
        else layer_activation_elems(arch, tp, sp, recompute, modules)
        for i in layers
    ]
    if lora is not None and lora.rank:
        adapters = {  # the same for every dense layer, and for every sparse one
            sparse: lora_layer_activation_elems(arch, lora, sparse, tp, sp, recompute, etp, pbytes, modules)
            for sparse in {arch.is_sparse(i) for i in layers}
        }
        per = [_plus(a, adapters[arch.is_sparse(i)]) for a, i in zip(per, layers)]
    return sum(a["kept"] for a in per), max((a["work"] for a in per), default=0.0)


def _plus(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def lora_layer_activation_elems(
    arch: Arch, lora, sparse: bool, tp: int, sp: bool, recompute: str, etp: int, pbytes: int, modules: tuple
) -> dict:
    """The adapters' share of one layer's {'kept', 'work'} (plan_lora.layer_activation_elems),
    recomputed as their base: the MLP's part with 'mlp' (a dense layer) or 'moe' (a sparse one),
    all of it with recompute full (the layer keeps only its input, counted already)."""
    parts = plan_lora.layer_activation_elems(
        arch, lora, sparse, tp=tp, sp=sp, etp=etp, pbytes=pbytes, imbalance=MOE_IMBALANCE
    )
    total = parts["attn"] + parts["mlp"]
    if recompute == "full":
        return {"kept": 0.0, "work": total}
    if recompute == "selective" and ("moe" if sparse else "mlp") in modules:
        return {"kept": parts["attn"], "work": parts["mlp"]}
    return {"kept": total, "work": 0.0}


def _dtype_bytes(name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[name]


def load_hf_config(hf_dir: str) -> dict:
    """config.json of model.hf_dir (relative paths: the working directory, then the repo)."""
    for base in (Path.cwd(), REPO):
        path = base / hf_dir / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise ValueError(f"config key 'model.hf_dir': {hf_dir!r} has no config.json (the plan needs only that file)")


def check_plan_layout(cfg, arch: Arch) -> None:
    """The trainer's layout rules (config.check_layout, the world being parallel.nodes x
    parallel.gpus_per_node) with the values that would pass; ValueError naming the fields."""
    par = cfg.parallel
    world = par.nodes * par.gpus_per_node
    try:
        check_layout(cfg, arch, world_size=world)
    except ValueError as e:
        choices = layout_choices(cfg, arch)
        hints = "; ".join(f"parallel.{k} among {v}" for k, v in choices.items() if getattr(par, k) not in v)
        split = (
            f" ({world - par.rollout_ranks} training + parallel.rollout_ranks={par.rollout_ranks})"
            if 0 < par.rollout_ranks < world
            else ""
        )
        raise ValueError(
            f"the trainer refuses this layout on parallel.nodes x parallel.gpus_per_node = "
            f"{par.nodes} x {par.gpus_per_node} = {world} GPUs{split}: {e}" + (f" (choose {hints})" if hints else "")
        ) from None


def _model_arch(hf_dir: str) -> tuple[Arch, dict]:
    raw = load_hf_config(hf_dir)
    try:
        return Arch.from_hf(raw), raw
    except ValueError as e:
        raise ValueError(f"config key 'model.hf_dir': {hf_dir}/config.json: {e}") from None


def _stage_bytes(
    cfg, arch: Arch, stage: str, layers: range, n_dense: int, n_expert: int, lay: dict, adapters: dict | None = None
) -> dict:
    """One pipeline stage's GPU: both phases' rows (bytes) and totals. `adapters`
    (plan_lora.adapter_params of the stage, model.lora.rank > 0): the base weights are frozen, the
    gradients and the optimizer state are the adapters' only."""
    par, roll = cfg.parallel, cfg.rollout
    pbytes = _dtype_bytes(cfg.model.dtype)
    T, tp, pp = cfg.trainer.max_tokens_per_microbatch, par.tp, par.pp
    # Adam m and v in fp32, plus the fp32 master copy when the params themselves are not fp32.
    opt_per_param = 8 + (4 if pbytes < 4 else 0)
    dist_opt = lay["distributed_optimizer"]
    n = n_dense + n_expert
    # What trains: every parameter, or (LoRA) only the adapters, which sit beside the frozen base.
    train_dense, train_expert = (adapters["dense"], adapters["expert"]) if adapters else (n_dense, n_expert)
    n_adapters = train_dense + train_expert if adapters else 0
    in_flight = pp if stage == "first" else 1  # 1F1B: stage 0 holds pp forwards before its first backward
    resident = {
        "weights": (n + n_adapters) * pbytes,
        "gradients": (train_dense + train_expert) * 4,
        # The distributed optimizer shards dense state over DP, an expert's over expert DP.
        "optimizer": opt_per_param
        * (train_dense / (lay["dp"] if dist_opt else 1) + train_expert / (lay["edp"] if dist_opt else 1)),
        # LoRA's reference is its own base with the adapters off (megatron/lora.py): no second copy.
        "reference": n * pbytes if cfg.algorithm.kl_coef > 0 and not adapters else 0,
    }
    sp = lay["sequence_parallel"]
    modules = tuple(lay["gpu_settings"]["recompute_modules"])
    lora = cfg.model.lora
    kept, work = stage_activation_elems(arch, layers, tp, sp, par.recompute, par.etp, pbytes, modules, lora)
    train = dict(resident)
    train["activations"] = (in_flight * kept + work) * T * pbytes
    if any(arch.is_sparse(i) for i in layers):  # one layer's dispatch send + receive in flight
        train["all_to_all"] = (1 + MOE_IMBALANCE) * arch.experts_per_tok * arch.hidden * T * pbytes / (tp if sp else 1)
    train["routing_replay"] = routing_replay_bytes(cfg, arch, layers, sp)
    last = stage in ("only", "last")
    train["logits"] = logits_bytes(T, padded_vocab_size(arch.vocab, tp) // tp, pbytes) if last else 0
    train["overhead"] = CUDA_OVERHEAD + FRAGMENTATION * sum(train.values())
    # The second phase: colocated, vLLM awake beside the resident state while it generates and
    # takes the new weights; with dedicated rollout ranks (lay["disaggregated"]), no vLLM here:
    # only the sending side of the weight transfer (rollout_gpu_bytes has the receiving side).
    gen = dict(resident)
    sync = _sync_peak(cfg, arch)
    if not lay["disaggregated"]:
        gen["vllm"] = roll.gpu_memory_utilization * par.gpu_memory_gb * GiB
    gen["weight_sync"] = sync["trainer"] if lay["disaggregated"] else sync["total"]
    gen["overhead"] = CUDA_OVERHEAD
    return {
        "params": n,
        "expert_params": n_expert,
        "adapter_params": n_adapters,
        "in_flight": in_flight,
        "train": train,
        "generate": gen,
        "train_total": sum(train.values()),
        "generate_total": sum(gen.values()),
    }


def routing_replay_bytes(cfg, arch: Arch, layers: range, sequence_parallel: bool) -> int:
    """rollout.routing_replay: each router of the stage holds its micro-batch's replayed experts on
    the GPU, tokens (this rank's, under sequence parallelism) x k int64 (megatron/routing_replay.py
    keeps one micro-batch's at a time); the [T, layers, k] int32 buffer of the micro-batch stays on
    the host. 0 when off or dense."""
    if not cfg.rollout.routing_replay:
        return 0
    sparse = sum(1 for i in layers if arch.is_sparse(i))
    tokens = cfg.trainer.max_tokens_per_microbatch // (cfg.parallel.tp if sequence_parallel else 1)
    return sparse * tokens * arch.experts_per_tok * 8


def logits_bytes(tokens: int, partition_vocab: int, pbytes: int, block: int = LOGPROB_BLOCK) -> int:
    """The loss's peak on the last stage: the model's logits (kept for the backward), their
    gradient, and the log-prob pass's fp32 blocks (no fp32 copy of the whole logits)."""
    elems = tokens * partition_vocab
    return 2 * elems * pbytes + LOGPROB_BLOCKS * min(elems, block) * 4


def _vllm_plan(cfg, arch: Arch, engine_gpus: int) -> dict:
    """vLLM: one engine per rollout_tp GPUs of the engine_gpus (the world colocated, the rollout
    ranks otherwise); weights (experts too) split over its ranks, KV heads split (replicated when
    rollout_tp > KV heads)."""
    par, roll = cfg.parallel, cfg.rollout
    rbytes = _dtype_bytes(roll.dtype or cfg.model.dtype)
    engines = engine_gpus // par.rollout_tp
    vllm_weights = arch.hf_params() * rbytes / par.rollout_tp
    lora = cfg.model.lora
    if lora.rank:  # beside the base weights: its one LoRA slot (rollout/vllm_engine.py, max_loras=1)
        vllm_weights += plan_lora.vllm_slot_params(arch, lora, par.rollout_tp) * rbytes
    kv_per_token = arch.kv_bytes_per_token(rbytes, par.rollout_tp)
    kv_cache = roll.gpu_memory_utilization * par.gpu_memory_gb * GiB - vllm_weights - VLLM_RUNTIME
    return dict(
        weights=vllm_weights,
        runtime=VLLM_RUNTIME,
        kv_cache=kv_cache,
        kv_per_token=kv_per_token,
        max_model_len=roll.max_model_len,
        seqs_fit=max(0, int(kv_cache // (roll.max_model_len * kv_per_token))),
        seqs_needed=math.ceil(cfg.trainer.prompts_per_step * roll.group_size / engines),
        host_ram_per_node=vllm_weights * par.gpus_per_node,
        sleep_level=roll.sleep_level,
    )


def _sync_peak(cfg, arch: Arch) -> dict:
    """sync_peak_bytes of this run: every weight, or (model.lora.rank > 0) only the adapters."""
    par, pbytes = cfg.parallel, _dtype_bytes(cfg.model.dtype)
    if cfg.model.lora.rank:
        return plan_lora.sync_peak_bytes(arch, cfg.model.lora, pbytes, pp=par.pp, ep=par.ep)
    return sync_peak_bytes(arch, pbytes, tp=par.tp, ep=par.ep, etp=par.etp, rollout_tp=par.rollout_tp)


def sync_bytes_per_step(cfg, arch: Arch) -> int:
    """What the weight sync sends each step, in model.dtype: every HF parameter, or the adapters."""
    lora = cfg.model.lora
    params = plan_lora.hf_adapter_params(arch, lora) if lora.rank else arch.hf_params()
    return params * _dtype_bytes(cfg.model.dtype)


def rollout_gpu_bytes(cfg, arch: Arch) -> dict:
    """One dedicated rollout GPU (parallel.rollout_ranks > 0): vLLM owns gpu_memory_utilization of
    the whole GPU (no Megatron state beside it, no sleep), and while the new weights arrive it holds
    one bucket of them as sent (max(1 GiB, the largest unit), whole: each rank keeps its shard) and
    its layer-wise reload (sync_peak_bytes' vLLM side); the process's CUDA context and the
    transfer group's NCCL buffers as on a training GPU."""
    par = cfg.parallel
    sync = _sync_peak(cfg, arch)
    rows = {
        "vllm": cfg.rollout.gpu_memory_utilization * par.gpu_memory_gb * GiB,
        "weight_receive": sync["bucket"],
        "weight_reload": sync["vllm"],
        "overhead": CUDA_OVERHEAD,
    }
    return {"rows": rows, "total": sum(rows.values())}


def gpu_settings(par, arch: Arch, world: int) -> dict:
    """parallel's GPU performance keys as a GPU run with Transformer Engine resolves them
    (config.resolve_gpu_settings; the plan models the fused GPU path). Their memory is in the
    rows already: DDP's buckets are views into the fp32 gradient buffer ('gradients'), and the
    wgrad temporaries that gradient_accumulation_fusion saves are left to the fragmentation term."""
    resolved = dataclasses.replace(par, recompute_modules=par.recompute_modules and list(par.recompute_modules))
    resolve_gpu_settings(resolved, cuda=True, te=True, moe=arch.experts > 0, world_size=world, wgrad_kernel=True)
    keys = ("overlap_grad_reduce", "ddp_bucket_size", "overlap_param_gather", "gradient_accumulation_fusion")
    keys += ("moe_permute_fusion", "moe_router_fusion")
    out = {k: getattr(resolved, k) for k in keys}
    out["recompute_modules"] = list(resolved.recompute_modules or DEFAULT_RECOMPUTE_MODULES)
    return out


def memory_plan(cfg, fixes: bool = True, model: tuple[Arch, dict] | None = None) -> dict:
    """Bytes per GPU for both phases of a step, the verdict and (fixes=True) the knobs that
    would fix a refused layout. Raises ValueError naming the field when the layout does not
    divide. `model`: (Arch, config.json) of model.hf_dir when the caller has read it already
    (a layout search plans one model many times)."""
    par = cfg.parallel
    arch, raw = model or _model_arch(cfg.model.hf_dir)
    check_plan_layout(cfg, arch)
    world = par.nodes * par.gpus_per_node
    # Dedicated rollout ranks take the last rollout_ranks GPUs; Megatron's layout covers the rest.
    rollout_gpus = par.rollout_ranks
    train_gpus = world - rollout_gpus
    tp, pp = par.tp, par.pp
    lay = dict(
        gpus=world,
        nodes=par.nodes,
        gpus_per_node=par.gpus_per_node,
        disaggregated=rollout_gpus > 0,
        train_gpus=train_gpus,
        rollout_gpus=rollout_gpus,
        tp=tp,
        pp=pp,
        dp=train_gpus // (tp * pp),
        ep=par.ep,
        etp=par.etp,
        edp=train_gpus // (par.ep * par.etp * pp),  # expert data parallel: what is left of the training GPUs
        sequence_parallel=par.sequence_parallel and tp > 1,
        distributed_optimizer=True if par.distributed_optimizer is None else par.distributed_optimizer,  # on with CUDA
        recompute=par.recompute,
        rollout_tp=par.rollout_tp,
        engines=(rollout_gpus or world) // par.rollout_tp,
        dtype=cfg.model.dtype,
        micro_batch_tokens=cfg.trainer.max_tokens_per_microbatch,
        reference=cfg.algorithm.kl_coef > 0,
        training=plan_lora.describe(cfg.model.lora),
    )
    lay["gpu_settings"] = gpu_settings(par, arch, train_gpus)
    modules = tuple(lay["gpu_settings"]["recompute_modules"])
    dense, experts = stage_params(arch, tp, pp), stage_expert_params(arch, par.ep, par.etp, pp)
    layers = _stage_layers(arch, pp)
    lora = cfg.model.lora
    adapters = {
        k: plan_lora.adapter_params(arch, lora, layers[k], tp, par.ep, par.etp) if lora.rank else None for k in dense
    }
    stages = {k: _stage_bytes(cfg, arch, k, layers[k], dense[k], experts[k], lay, adapters[k]) for k in dense}
    worst = max(stages, key=lambda s: max(stages[s]["train_total"], stages[s]["generate_total"]))
    pbytes = _dtype_bytes(cfg.model.dtype)
    first_layer = layers[worst][0]
    per_layer, _ = stage_activation_elems(
        arch, [first_layer], tp, lay["sequence_parallel"], par.recompute, par.etp, pbytes, modules, lora
    )
    plan = {
        "model": dict(
            dataclasses.asdict(arch),
            params=arch.hf_params(),
            active_params=arch.active_params(),
            padded_vocab=padded_vocab_size(arch.vocab, tp),
            model_type=raw.get("model_type", "?"),
        ),
        "layout": lay,
        "gpu_bytes": par.gpu_memory_gb * GiB,
        "activation_bytes_per_token_layer": per_layer * pbytes,
        "lora": dict(dataclasses.asdict(lora), adapter_params=plan_lora.hf_adapter_params(arch, lora))
        if lora.rank
        else None,
        "sync_bytes": sync_bytes_per_step(cfg, arch),
        "stages": stages,
        "worst_stage": worst,
        "vllm": _vllm_plan(cfg, arch, rollout_gpus or world),
        "rollout_gpu": rollout_gpu_bytes(cfg, arch) if rollout_gpus else None,
    }
    plan["problems"], plan["notes"] = _verdict(plan, cfg)
    plan["fits"] = not plan["problems"]
    plan["fixes"] = suggest_fixes(cfg, plan) if fixes and not plan["fits"] else []
    return plan


def _verdict(plan, cfg) -> tuple[list[str], list[str]]:
    gpu, v, disagg = plan["gpu_bytes"], plan["vllm"], plan["layout"]["disaggregated"]
    util = cfg.rollout.gpu_memory_utilization
    problems, notes = [], []
    for phase in ("train", "generate"):
        name, s = max(plan["stages"].items(), key=lambda kv: kv[1][phase + "_total"])
        where = "" if name == "only" else f" on the {name} pipeline stage"
        if s[phase + "_total"] > gpu:
            what, why = {
                "train": ("training", "Megatron's peak" + ("" if disagg else ", vLLM asleep")),
                "generate": ("generation", f"Megatron's resident state + vLLM's {util:.0%}"),
            }[phase]
            if disagg and phase == "generate":
                what, why = "the weight send", "Megatron's resident state + the sync's sending side"
            problems.append(
                f"{what} needs {s[phase + '_total'] / GiB:.1f} GiB per {'training ' if disagg else ''}GPU{where} "
                f"({why}) > {gpu / GiB:.0f} GiB"
            )
    if disagg and plan["rollout_gpu"]["total"] > gpu:
        problems.append(
            f"a rollout GPU needs {plan['rollout_gpu']['total'] / GiB:.1f} GiB (vLLM's {util:.0%} + the weights "
            f"arriving + CUDA context) > {gpu / GiB:.0f} GiB: lower rollout.gpu_memory_utilization"
        )
    if v["seqs_fit"] < 1:
        problems.append(
            f"vLLM's KV cache ({max(v['kv_cache'], 0) / GiB:.1f} GiB after its weights and runtime) "
            f"cannot hold one sequence of rollout.max_model_len={v['max_model_len']} "
            f"({v['max_model_len'] * v['kv_per_token'] / GiB:.2f} GiB)"
        )
    elif v["seqs_fit"] < v["seqs_needed"]:
        notes.append(
            f"vLLM holds {v['seqs_fit']} full-length sequences at once, the step asks "
            f"{v['seqs_needed']} per engine: generation runs in waves (raise "
            f"rollout.gpu_memory_utilization or parallel.rollout_tp for fewer)"
        )
    return problems, notes


def _candidates(cfg, plan) -> list[str]:
    """Single-knob changes worth trying, in the order we would recommend them."""
    par, lay = cfg.parallel, plan["layout"]
    out = []
    if not lay["distributed_optimizer"] and lay["dp"] > 1:
        out.append("parallel.distributed_optimizer=true")
    out += [
        f"parallel.recompute={r}"
        for r in ("selective", "full")
        if ("none", "selective", "full").index(r) > ("none", "selective", "full").index(par.recompute)
    ]
    if par.tp > 1 and not par.sequence_parallel and not cfg.model.lora.rank:  # LoRA: config/checks.py refuses it
        out.append("parallel.sequence_parallel=true")
    t = cfg.trainer.max_tokens_per_microbatch
    while t // 2 >= cfg.rollout.max_model_len:  # a full-length sequence must still fit
        t //= 2
        out.append(f"trainer.max_tokens_per_microbatch={t}")
    for u in (0.6, 0.5, 0.4, 0.3, 0.2):
        if u < cfg.rollout.gpu_memory_utilization:
            out.append(f"rollout.gpu_memory_utilization={u}")
    out += [f"parallel.rollout_tp={r}" for r in (2, 4, 8) if r > par.rollout_tp]
    if plan["model"]["experts"]:  # fewer experts per GPU
        out += [f"parallel.ep={e}" for e in (2, 4, 8, 16, 32, 64) if e > par.ep]
    out += [f"parallel.tp={t}" for t in (2, 4, 8) if t > par.tp]
    out += [f"parallel.pp={p}" for p in (2, 4, 8) if p > par.pp]
    # More GPUs shrink only what the distributed optimizer shards: offer the two together.
    dist = "" if lay["distributed_optimizer"] else " parallel.distributed_optimizer=true"
    out += [f"parallel.nodes={n}{dist}" for n in (2 * par.nodes, 4 * par.nodes)]
    return out


def _with(cfg, overrides: str):
    """A copy of cfg with space-separated section.key=value overrides applied (config.load's parser)."""
    return apply_overrides(copy.deepcopy(cfg), overrides.split())


def _peak(p) -> float:
    """The largest total of any GPU and phase (a dedicated rollout GPU's too)."""
    rollout = p["rollout_gpu"]["total"] if p["rollout_gpu"] else 0.0
    return max(rollout, *(max(s["train_total"], s["generate_total"]) for s in p["stages"].values()))


def _badness(p) -> tuple:
    """How far a plan is from fitting (0 when it fits); then its peak, to break ties."""
    over = max(0.0, _peak(p) - p["gpu_bytes"]) + (p["gpu_bytes"] if p["vllm"]["seqs_fit"] < 1 else 0)
    return over, _peak(p)


def suggest_fixes(cfg, plan, max_changes: int = 6) -> list[str]:
    """Single-knob changes that make the layout fit. When no single knob
    does, a greedy combination: repeatedly apply the change that brings it closest to fitting."""

    def tried(c, p):
        out = []
        for change in _candidates(c, p):
            try:
                out.append((_badness(q := memory_plan(_with(c, change), fixes=False)), change, q))
            except ValueError:
                continue  # does not divide: not a fix
        return sorted(out, key=lambda t: t[0])

    # Fitting single changes in the order _candidates recommends them (cheap knobs before
    # more hardware), not by peak: all of them fit.
    order = {c: i for i, c in enumerate(_candidates(cfg, plan))}
    singles = sorted(((order[ch], ch, bad) for bad, ch, q in tried(cfg, plan) if q["fits"]))
    if singles:
        return [f"{ch} (peak {bad[1] / GiB:.1f} GiB)" for _, ch, bad in singles[:6]]
    chosen, cur, cur_plan = {}, cfg, plan
    for _ in range(max_changes):
        options = tried(cur, cur_plan)
        # Stop when no change gains 1% of the GPU: more nodes shrink only the sharded optimizer
        # state, so repeating that change would approach a refusal without ever reaching a fit.
        if not options or options[0][0][0] > _badness(cur_plan)[0] - 0.01 * cur_plan["gpu_bytes"]:
            break
        bad, change, cur_plan = options[0]
        for part in change.split():  # a later value of the same knob replaces the earlier
            chosen[part.split("=")[0]] = part
        cur = _with(cur, change)
        if cur_plan["fits"]:
            return [" ".join(chosen.values()) + f" (together; peak {bad[1] / GiB:.1f} GiB)"]
    if not chosen:
        return []
    return [" ".join(chosen.values()) + f" (together they help, still {_badness(cur_plan)[0] / GiB:.1f} GiB over)"]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _gib(x: float) -> str:
    return f"{x / GiB:7.2f}"


def _model_line(m: dict) -> str:
    experts = ""
    if m["experts"]:
        experts = (
            f", {_count(m['active_params'])} active: {sum(m['sparse'])} MoE layers of {m['experts']} experts "
            f"(top-{m['experts_per_tok']}, width {m['moe_ffn']})"
        )
    return (
        f"model: {m['model_type']} {_count(m['params'])} params{experts} (hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}, ffn {m['ffn']}, vocab {m['vocab']} -> "
        f"{m['padded_vocab']} padded, {'tied' if m['tied'] else 'untied'} embeddings)"
    )


def _gpu_settings_line(lay: dict) -> str:
    g = lay["gpu_settings"]

    def on(key):
        return f"{key} {'on' if g[key] else 'off'}"

    bucket = f"buckets of {g['ddp_bucket_size'] / 1e6:.0f}M params" if g["ddp_bucket_size"] else "one bucket"
    parts = [f"{on('overlap_grad_reduce')} ({bucket})", on("overlap_param_gather"), on("gradient_accumulation_fusion")]
    if lay["ep"] > 1 or g["moe_permute_fusion"]:
        parts += [on("moe_permute_fusion"), on("moe_router_fusion")]
    if lay["recompute"] == "selective":
        parts.append(f"recompute_modules {g['recompute_modules']}")
    return "; ".join(parts) + " (memory: in the rows below)"


def format_plan(plan: dict) -> str:
    m, lay, v = plan["model"], plan["layout"], plan["vllm"]
    experts = f"; experts: EP {lay['ep']} x ETP {lay['etp']} x expert DP {lay['edp']}" if m["experts"] else ""
    disagg = lay["disaggregated"]
    split = (
        f" ({lay['train_gpus']} training GPUs, {lay['rollout_gpus']} rollout GPUs: parallel.rollout_ranks)"
        if disagg
        else ""
    )
    second = "send" if disagg else "generate"  # the second phase's column (see _stage_bytes)
    lines = [
        _model_line(m),
        f"layout: {lay['gpus']} GPUs = {lay['nodes']} x {lay['gpus_per_node']}{split}; "
        f"TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}{experts}; {lay['dtype']}; "
        f"sequence parallel {'on' if lay['sequence_parallel'] else 'off'}; "
        f"distributed optimizer {'on' if lay['distributed_optimizer'] else 'off'}; recompute {lay['recompute']}; "
        f"micro-batch {lay['micro_batch_tokens']} tokens; vLLM TP {lay['rollout_tp']} ({lay['engines']} engines"
        + (" on the rollout GPUs)" if disagg else ")")
        + f"; {lay['training']}",
        *_lora_lines(plan),
        f"activations: {plan['activation_bytes_per_token_layer'] / 1024:.1f} KiB per token per layer kept",
        "GPU settings: " + _gpu_settings_line(lay),
    ]
    rows = [
        ("weights", "weights"),
        ("gradients (fp32 main_grad)", "gradients"),
        ("optimizer (Adam m,v [+fp32 master])", "optimizer"),
        ("reference model", "reference"),
        ("activations", "activations"),
        ("all-to-all buffers (MoE dispatch)", "all_to_all"),
        ("routing replay (experts per token)", "routing_replay"),
        ("logits (loss)", "logits"),
        ("vLLM (weights+runtime+KV)", "vllm"),
        ("weight sync (largest unit in flight)", "weight_sync"),
        ("CUDA ctx/NCCL/fragmentation", "overhead"),
    ]
    gpu = "per training GPU" if disagg else "per GPU"
    for name, s in plan["stages"].items():
        lines.append(
            (
                f"{gpu}:"
                if name == "only"
                else f"{gpu}, {name} pipeline stage ({s['in_flight']} micro-batch(es) in flight):"
            )
            + (f" {_count(s['params'])} params, {_count(s['expert_params'])} of them experts" if m["experts"] else "")
        )
        lines.append(f"  {'GiB':<38}{'train':>8}{second:>10}")

        def cell(x):
            return "-".rjust(7) if x is None else _gib(x)

        for label, key in rows:
            tr, ge = s["train"].get(key), s["generate"].get(key)
            if (tr or 0) or (ge or 0):
                lines.append(f"  {label:<38} {cell(tr)}   {cell(ge)}")
        lines.append(
            f"  {'total of ' + format(plan['gpu_bytes'] / GiB, '.0f') + ' GiB':<38} "
            f"{_gib(s['train_total'])}   {_gib(s['generate_total'])}"
        )
    if disagg:
        lines += _rollout_gpu_lines(plan)
    sleep = (
        "a dedicated engine never sleeps (rollout.sleep_level is not used)"
        if disagg
        else f"sleep level 1 parks its weights in host RAM: {v['host_ram_per_node'] / GiB:.0f} GiB per node"
        if v["sleep_level"] == 1
        else f"sleep level 2 drops its weights (level 1 would park {v['host_ram_per_node'] / GiB:.0f} GiB "
        f"per node in host RAM)"
    )
    lines.append(
        f"vLLM per {'rollout ' if disagg else ''}GPU: weights {v['weights'] / GiB:.2f} GiB, runtime "
        f"{v['runtime'] / GiB:.1f} GiB, KV cache {v['kv_cache'] / GiB:.2f} GiB at {v['kv_per_token'] / 1024:.0f} "
        f"KiB/token = {v['seqs_fit']} sequences of {v['max_model_len']} tokens (step: {v['seqs_needed']} per "
        f"engine); {sleep}"
    )
    lines += [f"note: {n}" for n in plan["notes"]]
    if plan["fits"]:
        lines.append(f"FITS: peak {_peak(plan) / GiB:.1f} GiB of {plan['gpu_bytes'] / GiB:.0f} GiB per GPU")
    else:
        lines += [f"REFUSED: {p}" for p in plan["problems"]]
        if plan["fixes"]:
            lines += ["try one of:"] + [f"  {f}" for f in plan["fixes"]]
        else:
            lines.append("no single knob helps: more GPUs (parallel.nodes) or a smaller model")
    return "\n".join(lines)


def _lora_lines(plan: dict) -> list[str]:
    """The adapters' size and the sync's bytes per step (the sync sends them all, whatever the layout)."""
    sync = f"weight sync per step: {plan['sync_bytes'] / GiB:.2f} GiB"
    lora = plan["lora"]
    if not lora:
        return [sync + " (every weight)"]
    per_gpu = max(s["adapter_params"] for s in plan["stages"].values())
    share = lora["adapter_params"] / plan["model"]["params"]
    return [
        f"lora r={lora['rank']}: {_count(lora['adapter_params'])} adapter params ({share:.2%} of the model), "
        f"{_count(per_gpu)} on the fullest GPU; the base weights are frozen (no gradients, no optimizer state)",
        sync + f" (the adapters only, {1 / share:.0f}x less than every weight); gathered whole on every rank's "
        f"host: {plan['sync_bytes'] * plan['layout']['gpus_per_node'] / GiB:.1f} GiB of host RAM per node",
    ]


def _rollout_gpu_lines(plan: dict) -> list[str]:
    r = plan["rollout_gpu"]
    labels = {
        "vllm": "vLLM (weights+runtime+KV)",
        "weight_receive": "weights arriving (one bucket)",
        "weight_reload": "vLLM's layer-wise reload",
        "overhead": "CUDA ctx/NCCL",
    }
    lines = ["per rollout GPU:", f"  {'GiB':<38}{'generate':>8}"]
    lines += [f"  {labels[k]:<38} {_gib(x)}" for k, x in r["rows"].items()]
    lines.append(f"  {'total of ' + format(plan['gpu_bytes'] / GiB, '.0f') + ' GiB':<38} {_gib(r['total'])}")
    return lines


def plan_main(argv=None) -> int:
    """`megatron-dppo plan --config FILE [section.key=value ...]`: 0 fits, 1 does not fit,
    2 bad config or a layout that does not divide."""
    parser = argparse.ArgumentParser(prog="megatron-dppo plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=8")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--smallest",
        action="store_true",
        help="search the fewest GPUs this run fits on over parallel.tp, pp, ep, recompute and rollout_tp "
        "(the rest as configured) and plan that layout (jobs/plan_smallest.py)",
    )
    parser.add_argument("--max-gpus", type=int, default=1024, help="--smallest searches up to this many GPUs")
    step = parser.add_argument_group(
        "step time (measured per-phase throughput; given --gen-tokens-per-s and --train-tokens-per-s, the plan "
        "adds the step time colocated and with parallel.rollout_ranks: jobs/plan_step.py)"
    )
    step.add_argument("--gen-tokens-per-s", type=float, help="generated tokens/s per rollout GPU")
    step.add_argument("--train-tokens-per-s", type=float, help="trained tokens/s per training GPU, log-prob + update")
    step.add_argument(
        "--dedicated-gen-tokens-per-s", type=float, help="on a dedicated rollout GPU (default: colocated)"
    )
    step.add_argument(
        "--dedicated-train-tokens-per-s", type=float, help="on a dedicated training GPU (default: colocated)"
    )
    step.add_argument("--generated-tokens", type=int, help="generated tokens per step (default: the cap)")
    step.add_argument("--trained-tokens", type=int, help="trained tokens per step (default: the cap)")
    step.add_argument("--transfer-gb-per-s", type=float, help="GB/s of the weight transfer to the rollout ranks")
    step.add_argument("--sync-gb-per-s", type=float, help="GB/s of the colocated weight sync (default: the transfer's)")
    step.add_argument(
        "--tail-share",
        type=float,
        help="with parallel.rollout_ranks: the share of a colocated rollout spent on its longest completions "
        "(0 <= f < 1); adds the step at the config's trainer.max_staleness and rollout.partial, and the "
        "balanced split for it, from the pipeline model (jobs/plan_step.balanced_split, docs/scaling.md 2d)",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # the trainer's config checks, then its layout check
        if args.smallest:
            return _smallest_main(cfg, args)
        plan = memory_plan(cfg)
        if args.gen_tokens_per_s is not None or args.train_tokens_per_s is not None:
            plan["step_time"] = plan_step_time(cfg, plan, args)
        if args.tail_share is not None:
            plan["async_step_time"] = plan_async_step_time(cfg, plan, args)
    except (ValueError, OSError) as e:
        print(f"plan: {e}")
        return 2
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan))
        if "step_time" in plan:
            print("\n".join(format_step_times(plan["step_time"])))
        if "async_step_time" in plan:
            print(format_async_step_time(plan["async_step_time"]))
    return 0 if plan["fits"] else 1


def _smallest_main(cfg, args) -> int:
    """--smallest: the found layout's plan and a line naming it; 0 found, 1 nothing fits."""
    from megatron_dppo.jobs.plan_smallest import format_smallest, smallest_layout

    if args.max_gpus < 1:
        raise ValueError(f"--max-gpus: expected an integer >= 1, got {args.max_gpus}")
    found = smallest_layout(cfg, args.max_gpus)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print(("" if found is None else format_plan(found["plan"]) + "\n") + format_smallest(found, args.max_gpus))
    return 0 if found else 1


def plan_step_time(cfg, plan: dict, args) -> dict:
    """plan_step.step_times from plan_main's flags; the token counts default to the step's caps
    (every completion at rollout.max_new_tokens, every sequence at rollout.max_model_len)."""
    for flag in ("gen_tokens_per_s", "train_tokens_per_s"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')}: the step time needs both measured rates")
    t, r = cfg.trainer, cfg.rollout
    seqs = t.prompts_per_step * r.group_size
    sources = {}
    if args.generated_tokens is None:
        sources["generated_tokens"] = (
            f"not given: the cap, trainer.prompts_per_step x rollout.group_size x rollout.max_new_tokens = "
            f"{t.prompts_per_step} x {r.group_size} x {r.max_new_tokens}"
        )
    if args.trained_tokens is None:
        sources["trained_tokens"] = (
            f"not given: the cap, trainer.prompts_per_step x rollout.group_size x rollout.max_model_len = "
            f"{t.prompts_per_step} x {r.group_size} x {r.max_model_len}"
        )
    inp = StepInputs(
        generated_tokens=args.generated_tokens if args.generated_tokens is not None else seqs * r.max_new_tokens,
        trained_tokens=args.trained_tokens if args.trained_tokens is not None else seqs * r.max_model_len,
        gen_tokens_per_s=args.gen_tokens_per_s,
        train_tokens_per_s=args.train_tokens_per_s,
        dedicated_gen_tokens_per_s=args.dedicated_gen_tokens_per_s,
        dedicated_train_tokens_per_s=args.dedicated_train_tokens_per_s,
        transfer_gb_per_s=args.transfer_gb_per_s,
        sync_gb_per_s=args.sync_gb_per_s,
        sources=sources,
    )
    lay = plan["layout"]
    check_inputs(inp, lay["disaggregated"])
    weight_bytes = plan["sync_bytes"]  # what the sync sends: the weights, or the adapters only
    return step_times(inp, gpus=lay["gpus"], rollout_gpus=lay["rollout_gpus"], weight_bytes=weight_bytes)


def plan_async_step_time(cfg, plan: dict, args) -> dict:
    """--tail-share: plan_step.balanced_split at the config's trainer.max_staleness and
    rollout.partial, with plan_step_time's inputs, and this layout's own step."""
    from megatron_dppo.jobs.plan_step import AsyncInputs, async_step_times, balanced_split

    lay = plan["layout"]
    if not lay["disaggregated"]:
        raise ValueError("--tail-share: the pipeline model is for parallel.rollout_ranks > 0")
    base = plan.get("step_time") or plan_step_time(cfg, plan, args)
    inp = base["inputs"]
    k, partial = cfg.trainer.max_staleness, cfg.rollout.partial
    model = AsyncInputs(  # the colocated rollout's rate, its tail included: the model splits it
        generated_tokens=inp["generated_tokens"],
        trained_tokens=inp["trained_tokens"],
        gen_tokens_per_s=inp["gen_tokens_per_s"],
        train_tokens_per_s=inp["dedicated_train_tokens_per_s"] or inp["train_tokens_per_s"],
        tail_share=args.tail_share,
        weights_s=plan["sync_bytes"] / (inp["transfer_gb_per_s"] * 1e9),
        colocated_train_tokens_per_s=inp["train_tokens_per_s"],
    )
    here = async_step_times(model, gpus=lay["gpus"], rollout_gpus=lay["rollout_gpus"], staleness=k, partial=partial)
    best = balanced_split(model, gpus=lay["gpus"], staleness=k, partial=partial, multiple=cfg.parallel.rollout_tp)
    return {"staleness": k, "partial": partial, "tail_share": args.tail_share, "layout": here, "balanced": best}


def format_async_step_time(a: dict) -> str:
    here, best = a["layout"], a["balanced"]
    setting = f"trainer.max_staleness={a['staleness']}, rollout.partial={str(a['partial']).lower()}"
    return (
        f"pipeline model ({setting}, tail share {a['tail_share']}): {here['step_s']:.1f} s a step with "
        f"{here['rollout_gpus']} rollout GPUs of {here['gpus']} ({here['speedup']:.2f}x over colocated "
        f"{here['colocated_s']:.1f} s); balanced split {best['rollout_gpus']} rollout GPUs, {best['step_s']:.1f} s "
        f"({best['speedup']:.2f}x)"
    )


if __name__ == "__main__":
    import sys

    sys.exit(plan_main())
