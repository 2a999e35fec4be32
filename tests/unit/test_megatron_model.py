"""Megatron-Core model, attention, log-probs and parallel layouts, on CPU.

Model tests launch a worker script under torchrun (tests/dist/workers/model/*_worker.py): Megatron's parallel
state and the CPU shim are process-global, so they never run inside the pytest process. The
packed-attention kernels (megatron/attention.py) are plain functions of q/k/v and the row
layout: they are tested here, in-process, against attention written out independently.
"""

import random
from pathlib import Path

import pytest
import torch

DIST = Path(__file__).resolve().parents[1] / "dist" / "workers" / "model"


@pytest.mark.parametrize(
    "layout, expected",
    [
        (dict(world_size=3, tp=2, pp=1), "tp=2 x pp=1 must divide the world size 3"),
        (dict(world_size=8, tp=8, pp=1), "tp=8 must divide num_attention_heads 4"),
        (dict(world_size=4, tp=4, pp=1), "tp=4 must divide num_attention_heads 4 and num_key_value_heads 2"),
        (dict(world_size=6, tp=1, pp=3), "pp=3 must divide num_hidden_layers 4"),
        (dict(world_size=2, tp=0, pp=1), "must be >= 1"),
    ],
)
def test_model_layout_problems_name_the_fix(layout, expected):
    """Megatron-Core's layout rules (config/layout.py), each broken one named with the size to change."""
    from megatron_dppo.config.layout import model_layout_problems
    from megatron_dppo.model.arch import Arch

    model = Arch(vocab=50, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=96, tied=True)
    problems = "; ".join(model_layout_problems(model, **layout, show=lambda name, value: f"{name}={value}"))
    assert expected in problems
    assert "choose" in problems or "change" in problems or "must" in problems
    assert not model_layout_problems(model, world_size=8, tp=2, pp=2)  # DP 2


# ------------------------------------------------------------------------- packed attention


def _reference_attention(q, k, v, scale):
    """Causal softmax attention of ONE sequence, written out: q [n, hq, d], k/v [n, hk, d]."""
    n, hq, _ = q.shape
    rep = hq // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def _ragged_row(rng, n, gaps=True, tail=0):
    """Long-tailed lengths (1..~180, a few long, many short), random padding after each
    sequence when gaps, `tail` padding tokens at the end -> (lengths, starts, total)."""
    lengths = [max(1, min(180, int(rng.lognormvariate(2.3, 1.0)))) for _ in range(n)]
    starts, pos = [], 0
    for length in lengths:
        starts.append(pos)
        pos += length + (rng.randint(0, 5) if gaps else 0)
    return lengths, starts, pos + tail


def _row(lengths, starts, total):
    from megatron_dppo.megatron.attention import PackedRow

    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    dense = starts == cu[:-1].tolist() and total == int(cu[-1])
    padded = None if dense else torch.tensor(starts + [total], dtype=torch.int32)
    return PackedRow.from_cu(cu, padded, total)


def _qkv(total, hq, hk, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, d, generator=g).requires_grad_() for h in (hq, hk, hk)]


def _run(fn, qkv, w):
    out = fn(*qkv)
    return out.detach(), [g.detach() for g in torch.autograd.grad((out * w).sum(), qkv)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ragged+gaps+tail", "ragged dense", "uniform", "one sequence", "gqa=1 (mha)"])
def test_bucketed_attention_equals_each_sequence_alone_and_the_loop(case):
    """Forward and backward of the bucketed kernel equal (a) each sequence's attention computed
    alone, written out by hand, and (b) the per-sequence SDPA loop, within 1e-5 in fp32; padding
    tokens get zero outputs and zero gradients."""
    from megatron_dppo.megatron.attention import bucketed_attention, loop_attention

    rng = random.Random(case)
    hq, hk = (4, 4) if case.startswith("gqa=1") else (4, 2)
    if case == "uniform":
        lengths = [rng.randint(12, 16) for _ in range(40)]
        starts = [sum(lengths[:i]) for i in range(40)]
        total = sum(lengths)
    elif case == "one sequence":
        lengths, starts, total = [37], [0], 40
    else:
        lengths, starts, total = _ragged_row(rng, 30, gaps="dense" not in case, tail=3 if "tail" in case else 0)
    row = _row(lengths, starts, total)
    scale = 0.17
    qkv = _qkv(total, hq, hk, seed=len(lengths))
    w = torch.randn(total, hq * 32, generator=torch.Generator().manual_seed(1))
    out_b, grads_b = _run(lambda q, k, v: bucketed_attention(q, k, v, row, scale=scale), qkv, w)
    out_l, grads_l = _run(lambda q, k, v: loop_attention(q, k, v, row, scale=scale), qkv, w)

    real = torch.zeros(total, dtype=torch.bool)
    ref_out = torch.zeros(total, hq * 32)
    ref_grads = [torch.zeros_like(x) for x in qkv]
    for s, n in zip(starts, lengths):
        real[s : s + n] = True
        piece = [x.detach()[s : s + n].clone().requires_grad_() for x in qkv]
        o = _reference_attention(*piece, scale)
        ref_out[s : s + n] = o.detach()
        for acc, g in zip(ref_grads, torch.autograd.grad((o * w[s : s + n]).sum(), piece)):
            acc[s : s + n] = g
    for got, want, what in [
        (out_b, ref_out, "bucketed out"),
        (out_l, ref_out, "loop out"),
        *[(a, b, f"bucketed d{n}") for a, b, n in zip(grads_b, ref_grads, "qkv")],
        *[(a, b, f"loop d{n}") for a, b, n in zip(grads_l, ref_grads, "qkv")],
    ]:
        err = (got - want).abs().max().item()
        assert err < 1e-5, (what, err)
    assert (out_b[~real] == 0).all() and all((g[~real] == 0).all() for g in grads_b)
    if case == "ragged+gaps+tail":  # the grouping really batches: fewer calls than sequences
        assert 1 < len(row.bucket_plan("cpu", 2000).shapes) < len(lengths) / 3


def _call_cost(widths_counts, cost):
    return sum(cost + n * w * (w + 1) / 2 for w, n in widths_counts)


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1 :]
        yield [[first]] + p


def test_bucket_sequences_is_optimal_against_brute_force():
    """The dynamic program's grouping costs no more than the best of ALL set partitions
    (brute force, up to 7 sequences), and is a partition of the non-empty sequences."""
    from megatron_dppo.megatron.attention import bucket_sequences

    rng = random.Random(3)
    for _ in range(60):
        lengths = [rng.choice([0, 1, 2, 5, 9, 30, 31, 100]) for _ in range(rng.randint(1, 7))]
        cost = rng.choice([0.0, 10.0, 500.0, 1e6])
        groups = bucket_sequences(lengths, cost)
        assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(lengths) if n > 0]

        def total(partition, lengths=lengths, cost=cost):
            return _call_cost([(max(lengths[i] for i in g), len(g)) for g in partition], cost)

        real = [i for i, n in enumerate(lengths) if n > 0]
        best = min((total(p) for p in _partitions(real)), default=0.0)
        assert total(groups) <= best + 1e-6, (lengths, cost, groups)
    assert bucket_sequences([5, 5, 9, 1], 1e9) == [[2, 0, 1, 3]]  # calls dear: one group, longest first
    assert bucket_sequences([5, 5, 9, 1], 0.0) == [[2], [0, 1], [3]]  # calls free: no padding at all
    assert bucket_sequences([0, 0], 1.0) == []


@pytest.mark.parametrize(
    "facts, requested, expected",
    [
        (dict(), "auto", "varlen"),
        (dict(), "bucketed", "bucketed"),
        (dict(), "loop", "loop"),
        (dict(device_type="cpu"), "auto", "bucketed"),
        (dict(dtype=torch.float32), "auto", "bucketed"),
        (dict(dropout_p=0.1), "auto", "bucketed"),
        (dict(head_dim=36), "auto", "bucketed"),
        (dict(head_dim=512), "auto", "bucketed"),
        (dict(varlen_importable=False), "auto", "bucketed"),
        (dict(flash_usable=False), "auto", "bucketed"),
        (dict(device_type="cpu"), "varlen", "needs CUDA"),
        (dict(dtype=torch.float32), "varlen", "float16/bfloat16"),
    ],
)
def test_choose_thd_impl(facts, requested, expected):
    """varlen where everything allows it (CUDA, fp16/bf16, no dropout, head_dim, a flash GPU);
    the bucketed path otherwise; forcing varlen where it cannot run says why."""
    from megatron_dppo.megatron.attention import choose_thd_impl

    call = dict(
        device_type="cuda", dtype=torch.bfloat16, dropout_p=0.0, head_dim=128, varlen_importable=True, flash_usable=True
    )
    call.update(facts)
    if expected in ("varlen", "bucketed", "loop"):
        assert choose_thd_impl(requested, **call) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            choose_thd_impl(requested, **call)
    with pytest.raises(ValueError, match="expected one of auto, varlen, bucketed, loop"):
        choose_thd_impl("flash", **call)


def test_varlen_call_is_wired_right(monkeypatch):
    """The varlen branch cannot run without a GPU; with torch's varlen_attn replaced by a
    reference that checks its arguments (segment offsets, causal window, GQA flag, max length)
    and computes per-segment causal attention, it equals the loop on real tokens and gives
    zeros on padding: what is left untested here is the flash kernel itself."""
    from megatron_dppo.megatron import attention

    lengths, starts, total = _ragged_row(random.Random(5), 12, gaps=True, tail=2)
    row = _row(lengths, starts, total)
    seen = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        seen.update(window=window_size, gqa=enable_gqa, max=(max_q, max_k), cu=cu_q.tolist())
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and max_q == max_k
        bounds = cu_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.size(0)
        assert max_q >= max(b - a for a, b in zip(bounds, bounds[1:]))
        out = torch.cat([_reference_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in zip(bounds, bounds[1:])])
        return out.view(q.shape)

    monkeypatch.setattr(attention, "varlen_attn", fake_varlen)
    q, k, v = _qkv(total, 4, 2)
    got = attention.varlen_attention(q, k, v, row, scale=0.2)
    want = attention.loop_attention(q, k, v, row, scale=0.2)
    assert (got - want).abs().max() < 1e-5
    assert seen["window"] == (-1, 0) and seen["gqa"] is True
    assert seen["cu"] == starts + [total]  # the padded segments, tail padding in the last one


def test_varlen_without_enable_gqa_repeats_the_kv_heads(monkeypatch):
    """torch 2.11's varlen_attn has no enable_gqa (the first GPU run, docs/profiling.md, failed on
    it): there the kv heads are repeated so that query head h reads kv head h // group, and the
    result still equals the loop."""
    from megatron_dppo.megatron import attention

    lengths, starts, total = _ragged_row(random.Random(6), 10, gaps=True, tail=1)
    row = _row(lengths, starts, total)

    def varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert k.size(1) == v.size(1) == q.size(1), (q.shape, k.shape)
        bounds = cu_q.tolist()
        out = torch.cat([_reference_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in zip(bounds, bounds[1:])])
        return out.view(q.shape)

    monkeypatch.setattr(attention, "varlen_attn", varlen_2_11)
    monkeypatch.setattr(attention, "VARLEN_HAS_GQA", False)
    q, k, v = _qkv(total, 6, 2)
    got = attention.varlen_attention(q, k, v, row, scale=0.2)
    want = attention.loop_attention(q, k, v, row, scale=0.2)
    assert (got - want).abs().max() < 1e-5


def test_packed_seq_params_from_thd_batches():
    """What reaches Megatron: qkv_format thd and the PADDED offsets as cu_seqlens, with
    cu_seqlens_padded None and pad_between_seqs False where PackedSeqParams has the field
    (megatron-core 0.19): TE then sees a dense row, so it neither compares cu_seqlens with
    cu_seqlens_padded on the device in every layer nor turns FlashAttention off (issue 22.4;
    that the log-probs stay exact is tests/dist/workers/model/tp_worker.py's check_packing). The row layout is
    precomputed on the host; None for the padded baseline."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_dppo.algorithms.packing import Sample, build_padded_batch, build_thd_batch
    from megatron_dppo.megatron.attention import packed_seq_params

    has_flag = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}
    samples = [Sample(tokens=list(range(1, n + 1)), prompt_len=1) for n in (5, 8, 3)]
    for multiple, offsets in ((1, [0, 5, 13, 16]), (4, [0, 8, 16, 20])):
        batch = build_thd_batch(samples, pad_multiple=multiple)
        assert batch.cu_seqlens.tolist() == [0, 5, 13, 16] and batch.cu_seqlens_padded.tolist() == offsets
        p = packed_seq_params(batch, device="cpu")
        assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
        assert p.cu_seqlens_q.tolist() == offsets and p.cu_seqlens_q is p.cu_seqlens_kv
        assert p.cu_seqlens_q.dtype == torch.int32
        assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
        assert getattr(p, "pad_between_seqs", None) is (False if has_flag else None)
        longest = max(b - a for a, b in zip(offsets, offsets[1:]))
        assert p.max_seqlen_q == p.max_seqlen_kv == longest and isinstance(p.max_seqlen_q, int)
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        assert (p.row.starts, p.row.lengths, p.row.total) == (offsets[:-1], lengths, offsets[-1])
    assert packed_seq_params(build_padded_batch(samples)) is None


def test_packed_row_rejects_a_layout_that_does_not_fit():
    from megatron_dppo.megatron.attention import PackedRow

    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed sequence 1 \(start 2, length 5\) does not fit"):
        PackedRow.from_cu(cu, torch.tensor([0, 2, 9], dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="does not fit the row of 8 tokens"):
        PackedRow.from_cu(cu, None, 8)
    with pytest.raises(ValueError, match="one offset per sequence"):
        PackedRow.from_cu(cu, torch.tensor([0, 9], dtype=torch.int32), 9)


def test_thd_kernel_is_the_config_choice_fixed_at_build_time():
    """model.thd_attention reaches every layer's attention through the layer spec (no environment
    read per call), and a bad value is refused naming the key, by the config and by the module."""
    from megatron_dppo.config import load_config
    from megatron_dppo.megatron.attention import PackedDotProductAttention
    from megatron_dppo.megatron.model import layer_spec

    config = str(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "addition.yaml")
    core = layer_spec("local", "loop").submodules.self_attention.submodules.core_attention
    assert core.module is PackedDotProductAttention and core.params == {"thd_impl": "loop"}
    assert load_config(config, ["model.thd_attention=bucketed"]).model.thd_attention == "bucketed"
    with pytest.raises(ValueError, match="'model.thd_attention': expected one of"):
        load_config(config, ["model.thd_attention=fast"])
    with pytest.raises(ValueError, match="'model.thd_attention': expected one of"):
        PackedDotProductAttention.__init__(object.__new__(PackedDotProductAttention), thd_impl="fast")


# ------------------------------------------------------------------------- importing Megatron-Core
_IMPORT_CHECK = """
import sys, torch
compile_ = torch.compile
import megatron_dppo.megatron
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu
inductor = "torch._inductor.compile_fx" in sys.modules
compiled = lambda fn: hasattr(fn, "_torchdynamo_orig_callable")  # what a torch.compile wrapper carries
assert compiled(torch.compile(lambda x: x)), "the wrapper check cannot see a compiled function"
print(torch.compile is compile_, jit.jit_fuser is jit.noop_decorator,
      compiled(fused_bias_geglu.geglu) or compiled(fused_bias_swiglu.swiglu), inductor)
"""


def test_megatron_core_imports_without_torchinductor_on_cpu():
    """cpu_compat.import_megatron_core: on CPU Megatron-Core's fused kernels are plain functions (the
    model config turns every fusion off, so none is called), TorchInductor is not imported for them,
    and torch.compile is torch's own again afterwards (a fresh process: the import happens once)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    restored, switched_off, wrapped, inductor = res.stdout.split()
    assert (restored, switched_off, wrapped, inductor) == ("True", "True", "False", "False"), res.stdout
