"""Model FLOPs, MFU, device peaks and per-phase step summaries (docs/profiling.md).

The FLOP count is the usual "model FLOPs" (what the model needs, not what the kernels happen to
do: recomputation, padding and Megatron's padded vocabulary rows are NOT counted), for a Qwen3
style decoder (GQA attention, SwiGLU MLP, no biases):

    forward FLOPs of one token at position i (0-based) of its sequence
        = 2 * N_matmul                          every weight matmul: a multiply and an add
        + 4 * n_layers * n_heads * head_dim * (i + 1)    QK^T and AV over the i+1 keys it sees

    N_matmul = n_layers * (h*(n_heads + 2*n_kv)*d + n_heads*d*h + 3*h*ffn) + vocab*h
               (QKV, out-proj, fc1 [gate; up], fc2, and the output head whether tied or not;
                the embedding lookup is a gather, not a matmul; norms and RoPE are ignored)

A packed micro-batch is a set of independent causal sequences (attention never crosses their
boundaries), so a sequence of L tokens costs 2*N_matmul*L + 4*n_layers*n_heads*d*L(L+1)/2:
linear in the total token count, quadratic per sequence. Training (forward + backward) is 3x the
forward: backward computes a gradient for both the input and the weight of every matmul.

Everything here is plain arithmetic on the HF config.json (a transformers config or a dict);
only `measure_matmul_flops` and `detect_device` touch torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from megatron_dppo.model.arch import Arch

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendor data sheets, FLOP/s per GPU.
# H200 is the H100's compute die with more and faster memory: same peak.
DEVICE_PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


def _arch(hf_config) -> Arch:
    if isinstance(hf_config, Arch):
        return hf_config
    d = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    return Arch.from_hf(d)


def matmul_params(hf_config) -> int:
    """Weights that take part in a matmul for every token (see the module docstring)."""
    a = _arch(hf_config)
    return a.layers * (a.attention_params() + a.dense_mlp_params()) + a.vocab * a.hidden


def forward_flops_breakdown(hf_config, seq_lengths: Iterable[int]) -> dict:
    """{'linear', 'attention', 'total'} forward FLOPs of independent causal sequences."""
    a = _arch(hf_config)
    lengths = [int(n) for n in seq_lengths]
    linear = 2 * matmul_params(a) * sum(lengths)
    # sum over positions of the keys each token sees: 1 + 2 + ... + L per sequence
    attention = 4 * a.layers * a.heads * a.head_dim * sum(n * (n + 1) // 2 for n in lengths)
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def forward_flops(hf_config, seq_lengths: Iterable[int]) -> float:
    return forward_flops_breakdown(hf_config, seq_lengths)["total"]


def train_flops(hf_config, seq_lengths: Iterable[int]) -> float:
    """Forward + backward of one optimizer step's sequences: 3x the forward."""
    return 3.0 * forward_flops(hf_config, seq_lengths)


def generation_flops(hf_config, prompt_len: int, completion_lengths: Iterable[int]) -> float:
    """Forward FLOPs of sampling a group: the prompt is prefilled once (the G samples share it),
    then each completion token is one forward step over the context before it. A token's cost
    depends only on its position, so that is a full sequence minus the shared prompt."""
    prompt = forward_flops(hf_config, [prompt_len])
    return prompt + sum(forward_flops(hf_config, [prompt_len + n]) - prompt for n in completion_lengths)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak FLOP/s."""
    return flops / seconds / peak if seconds > 0 and peak > 0 else 0.0


def detect_device() -> str:
    """'h100' / 'h200' / 'a100' for those GPUs, the CUDA device name for others, else 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for kind in DEVICE_PEAK_FLOPS:
        if kind in name:
            return kind
    return name


def measure_matmul_flops(n: int = 1024, dtype=None, seconds: float = 0.5, device: str = "cpu") -> float:
    """Best FLOP/s of repeated n x n matmuls over ~`seconds`: a practical peak for a device with
    no data-sheet number (a CPU). Best-of, because other jobs sharing the cores only slow it.
    dtype defaults to fp32 on CPU (the CPU runs train in fp32) and bf16 on a GPU."""
    import torch

    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    a @ b  # warm-up: thread pool, allocator
    sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def device_peak_flops(kind: str = "auto", override: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from): `override` if given (any device), else for the GPUs
    of the table their bf16 dense data-sheet peak, else (a CPU, an unknown GPU) measured with
    `measure_matmul_flops`."""
    kind = detect_device() if kind == "auto" else kind.lower()
    if override:
        return float(override), f"{kind}: given on the command line"
    if kind in DEVICE_PEAK_FLOPS:
        return DEVICE_PEAK_FLOPS[kind], f"{kind.upper()} bf16 dense data sheet"
    device = "cpu" if kind == "cpu" else "cuda"
    dt = "fp32" if device == "cpu" else "bf16"
    return measure_matmul_flops(device=device), f"{kind}: measured (best 1024x1024 {dt} matmul, torch threads now)"


PHASES = ("rollout", "reward", "logprob", "train", "sync")


def phase_totals(steps: list[dict]) -> dict:
    """Seconds per phase summed over trainer metrics dicts (their time/<phase>)."""
    return {p: sum(s.get(f"time/{p}", 0.0) for s in steps) for p in PHASES}


def summarize_phases(steps: list[dict]) -> dict:
    """Mean seconds per phase over trainer metrics dicts (time/<phase>, time/step), with 'other'
    = step time the phases do not cover (pruning, packing, advantages, python)."""
    if not steps:
        return {}
    n = len(steps)
    out = {p: total / n for p, total in phase_totals(steps).items()}
    out["step"] = sum(s["time/step"] for s in steps) / n
    out["other"] = max(out["step"] - sum(out[p] for p in PHASES), 0.0)
    return out
