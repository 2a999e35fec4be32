"""Core attention for Megatron-Core's local layer spec that understands packed (THD) batches.

Megatron's local DotProductAttention refuses packed_seq_params, and no public Megatron-Core
backend does varlen attention without Transformer Engine. `PackedDotProductAttention` is a
drop-in `core_attention` for get_gpt_layer_local_spec (same constructor) that runs causal
attention within each packed sequence, on CPU and on a GPU without TE. TE stays the default
where it exists (model.py); this module is the fallback.

Layouts Megatron-Core 0.16 hands to core_attention (transformer/attention.py):
  plain:  query [s, b, np, hn], key/value [s, b, ng, hn]  ->  returns [s, b, np*hn]
  packed: query [t, np, hn],    key/value [t, ng, hn]     ->  returns [t, np*hn]
          (SelfAttention squeezes the dummy batch dim before and restores it after)
np / ng are this TP rank's query heads / KV groups (GQA when np > ng).

Packed layout: sequence i occupies tokens [start_i, start_i + len_i) of the row, where
len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i] and start_i = cu_seqlens_q_padded[i] (or
cu_seqlens_q[i] when cu_seqlens_q_padded is None: no padding between sequences). Tokens after a
sequence up to the next start are padding: nobody attends to them and their outputs are zero.
RoPE positions restart at each start (Megatron's _apply_rotary_pos_emb_thd splits the row by
the padded offsets, or by cu_seqlens when the padded ones are None), so real tokens get
positions 0..len_i-1. That RoPE also constrains the batch (measured; it fails otherwise):
max_seqlen_q must be at least the longest PADDED segment, and the last offset (padded if given,
else cu_seqlens_q[-1]) must equal the row length (put any tail padding into the last segment).

Three implementations of the packed forward, chosen per call by `choose_thd_impl`:
  "varlen"    torch.nn.attention.varlen.varlen_attn (flash kernels): CUDA, fp16/bf16, no
              dropout, head_dim a multiple of 8 up to 256, a GPU with flash attention (sm80+).
              One kernel over the whole row; runs over the padded segments (a segment's
              padding follows its real tokens, so causal attention keeps real tokens exact)
              and zeroes the padding outputs.
  "bucketed"  everywhere else: the row's sequences are grouped by length (`bucket_sequences`,
              padding waste traded against the fixed cost of a call), gathered into one
              [rows, heads, width, hn] batch per group, ONE causal SDPA per group, and
              scattered back. Right-padding under a causal mask never reaches a real query,
              so real tokens are exact, backward included.
  "loop"      one SDPA per sequence: the reference the other two are tested against and the
              benchmark baseline (tools/bench_packing.py). Not chosen by "auto".
The config key model.thd_attention (auto | varlen | bucketed | loop) forces one, e.g. to compare
them side by side through the CLI; it is fixed when the model is built (`PackedDotProductAttention(
thd_impl=...)`), and only the facts of a call (device, dtype, dropout) are read per call.

`packed_seq_params(batch)` turns a packed ThdBatch (megatron_dppo.algorithms.packing) into Megatron's
PackedSeqParams, with each sequence's padding counted as part of it (see there: exact, and TE
keeps its flash kernels without a device sync); it also precomputes the row layout on the
host, once per micro-batch, so no layer reads cu_seqlens back from the device.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from contextlib import nullcontext
from typing import get_args

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_dppo.algorithms.choices import ThdAttention

try:  # torch >= 2.10 (flash-attention varlen); absent or unusable on older builds
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None

# torch 2.11's varlen_attn has no enable_gqa (2.13's has): there the kv heads are repeated first,
# which is what enable_gqa does inside the kernel (query head h reads kv head h // group).
VARLEN_HAS_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

THD_IMPLS = get_args(ThdAttention)

# Fixed cost of one bucket (a batched SDPA call with its gather, forward + backward), in units
# of one causal query-key pair times one head-dimension: ~80 us on the 2-core development CPU,
# which is what ~2000 causal pairs cost at 4 heads x 32 dims (docs/packing.md). Dividing by
# heads * head_dim gives it in pairs: wide models make padding dearer, so they bucket finer.
BUCKET_CALL_COST = 2000 * 4 * 32


# ---------------------------------------------------------------------------------- dispatch


def varlen_blocker(
    *,
    device_type: str,
    dtype: torch.dtype,
    dropout_p: float,
    head_dim: int,
    varlen_importable: bool,
    flash_usable: bool,
) -> str | None:
    """Why torch's varlen flash attention cannot run this call (None: it can). Pure: the
    facts about the call are arguments, so the dispatch is tested on a machine without a GPU."""
    if not varlen_importable:
        return "torch.nn.attention.varlen does not import in this torch build"
    if device_type != "cuda":
        return f"tensors are on {device_type}, varlen attention needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (flash kernels take float16/bfloat16)"
    if dropout_p:
        return f"attention dropout {dropout_p} (varlen_attn has none)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (flash kernels need a multiple of 8, at most 256)"
    if not flash_usable:
        return "this GPU has no flash attention (needs sm80 or newer)"
    return None


def choose_thd_impl(requested: str, **facts) -> str:
    """requested ("auto" | "varlen" | "bucketed" | "loop") + facts (see varlen_blocker) -> the
    implementation to run. "auto" prefers varlen where it applies; forcing varlen where it
    cannot run is an error saying why."""
    if requested not in THD_IMPLS:
        raise ValueError(f"packed attention implementation {requested!r}: expected one of {', '.join(THD_IMPLS)}")
    if requested in ("bucketed", "loop"):
        return requested
    blocker = varlen_blocker(**facts)
    if requested == "varlen" and blocker:
        raise ValueError(f"model.thd_attention=varlen cannot run here: {blocker}")
    return "varlen" if blocker is None else "bucketed"


@functools.cache
def _flash_usable(device_index: int) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device_index) >= (
        8,
        0,
    )


def _call_facts(query: torch.Tensor, dropout_p: float) -> dict:
    cuda = query.device.type == "cuda"
    return dict(
        device_type=query.device.type,
        dtype=query.dtype,
        dropout_p=dropout_p,
        head_dim=query.size(-1),
        varlen_importable=varlen_attn is not None,
        flash_usable=cuda and _flash_usable(query.device.index or 0),
    )


# ------------------------------------------------------------------------------- the row plan


def bucket_sequences(lengths, call_cost_pairs: float) -> list[list[int]]:
    """Group sequences (by index) so that sum over groups of
        call_cost_pairs + rows * width * (width + 1) / 2      (width = the group's longest)
    is minimal: each group becomes one causal SDPA over a [rows, width] padded batch, whose
    work is the causal pairs of its padded rows plus a fixed cost per call.

    Sorted by length, an optimal grouping takes contiguous runs (a sequence in a wider group
    than a longer one could swap without cost), so a dynamic program over the distinct lengths
    finds it in O(m^2) numpy work, m = number of distinct lengths. Zero-length sequences have
    no tokens and are in no group. Groups come longest first, each longest first (ties: index).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    if not order:
        return []
    values, counts = np.unique(np.array([lengths[i] for i in order], dtype=np.float64), return_counts=True)
    values, counts = values[::-1], counts[::-1]  # longest first
    m = len(values)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    pairs = values * (values + 1) / 2  # causal pairs of one row of each width
    best = np.zeros(m + 1)
    cut = np.zeros(m + 1, dtype=np.int64)
    for j in range(1, m + 1):  # groups = distinct-length runs [i, j); the widest is values[i]
        cost = best[:j] + call_cost_pairs + (prefix[j] - prefix[:j]) * pairs[:j]
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    bounds, j = [], m
    while j > 0:
        bounds.append((int(prefix[cut[j]]), int(prefix[j])))
        j = cut[j]
    return [order[a:b] for a, b in reversed(bounds)]


@dataclasses.dataclass
class BucketPlan:
    """How one packed row maps onto its buckets' padded [rows, width] batches.

    The buckets' slots are laid out one after another (bucket b: `shapes[b]` = (rows, width),
    row-major), S slots in all. A slot is real (holds token t of its sequence) or padding.
      gather   [S]  slot -> token; a padding slot repeats its row's last real token (it sits after
                    the row's real tokens, so only padding queries, whose outputs are dropped,
                    ever see it: real tokens' outputs and gradients stay exact)
      inverse  [T]  token -> its real slot; tokens outside every sequence -> S (a zero row)
    """

    shapes: list[tuple[int, int]]
    sizes: list[int]  # slots of each bucket
    gather: torch.Tensor
    inverse: torch.Tensor
    gaps: bool  # some token is in no sequence (inverse uses the zero row)


@dataclasses.dataclass
class PackedRow:
    """Where the sequences of one packed row are (host lists) and the index tensors the
    bucketed and varlen paths need, built once per micro-batch and shared by every layer."""

    lengths: list[int]
    starts: list[int]
    total: int  # tokens in the row, padding included
    max_seqlen: int  # longest segment (padded when there is padding)
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_cu(cls, cu_seqlens, cu_seqlens_padded, total: int, max_seqlen: int | None = None) -> PackedRow:
        cu = [int(x) for x in cu_seqlens.tolist()]
        starts = cu[:-1] if cu_seqlens_padded is None else [int(x) for x in cu_seqlens_padded.tolist()[:-1]]
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if len(starts) != len(lengths):
            raise ValueError(
                f"cu_seqlens_padded has {len(starts) + 1} entries, cu_seqlens {len(cu)}: "
                "expected one offset per sequence plus one"
            )
        end = 0
        for i, (s, n) in enumerate(zip(starts, lengths)):
            if n < 0 or s < end or s + n > total:
                raise ValueError(
                    f"packed sequence {i} (start {s}, length {n}) does not fit the row of "
                    f"{total} tokens after the previous sequence's end {end}"
                )
            end = s + n
        bounds = starts[1:] + [total]
        segment = max([b - a for a, b in zip(starts, bounds)], default=0)
        return cls(lengths, starts, total, max(segment, max_seqlen or 0))

    @property
    def has_padding(self) -> bool:
        return sum(self.lengths) != self.total

    def bucket_plan(self, device, call_cost_pairs: float) -> BucketPlan:
        key = ("buckets", str(device), call_cost_pairs)
        if key not in self._cache:
            groups = bucket_sequences(self.lengths, call_cost_pairs)
            shapes = [(len(g), self.lengths[g[0]]) for g in groups]
            sizes = [rows * width for rows, width in shapes]
            gather = [torch.zeros(0, dtype=torch.long)]
            inverse = torch.full((self.total,), sum(sizes), dtype=torch.long)
            offset = 0
            for g, (rows, width) in zip(groups, shapes):
                starts = torch.tensor([self.starts[i] for i in g])[:, None]
                lens = torch.tensor([self.lengths[i] for i in g])[:, None]
                pos = torch.arange(width)[None]
                token = starts + torch.minimum(pos, lens - 1)
                real = pos < lens
                gather.append(token.flatten())
                inverse[token[real]] = offset + torch.arange(rows * width).view(rows, width)[real]
                offset += rows * width
            self._cache[key] = BucketPlan(
                shapes, sizes, torch.cat(gather).to(device), inverse.to(device), gaps=sum(self.lengths) < self.total
            )
        return self._cache[key]

    def varlen_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(segment offsets [S+1] int32, real-token mask [t, 1, 1] or None without padding)."""
        key = ("varlen", str(device))
        if key not in self._cache:
            offsets = torch.tensor(self.starts + [self.total], dtype=torch.int32)
            mask = None
            if self.has_padding:
                mask = torch.zeros(self.total, 1, 1, dtype=torch.bool)
                for s, n in zip(self.starts, self.lengths):
                    mask[s : s + n] = True
                mask = mask.to(device)
            self._cache[key] = (offsets.to(device), mask)
        return self._cache[key]


@dataclasses.dataclass
class PackedRowParams(PackedSeqParams):
    """PackedSeqParams plus the host-side row layout. Megatron and TE read only the base
    fields (TE collects them with dataclasses.fields(PackedSeqParams)), so `row` travels along
    unseen by them."""

    row: PackedRow | None = None


# Megatron-Core >= 0.19 lets the caller say whether sequences have padding between them; TE
# otherwise works it out by comparing cu_seqlens with cu_seqlens_padded on the device.
_HAS_PAD_BETWEEN_SEQS = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}


def packed_seq_params(batch, device=None) -> PackedSeqParams | None:
    """Megatron PackedSeqParams (qkv_format "thd") of a packed ThdBatch; None for a padded
    [rows, L] batch. Tensors go to `device` (default: where they are).

    The sequence boundaries given are the PADDED offsets (batch.cu_seqlens_padded: each
    sequence with the padding after it, under sequence parallelism a multiple of TP), as
    cu_seqlens, with cu_seqlens_padded None and pad_between_seqs False (where the installed
    PackedSeqParams has that field): to TE the row is dense. Exact, because attention is causal
    and a segment's padding comes after its real tokens, so no real token sees padding; the
    padding positions compute something, which the loss mask drops. Passing the real lengths
    beside different padded ones instead makes TE compare the two on the device in every layer
    (a host sync per attention call, forward and recompute) and turn FlashAttention off. RoPE
    restarts at each segment start either way, and this module's attention reads the same
    segments."""
    if batch.cu_seqlens is None:
        return None
    offsets = batch.cu_seqlens if batch.cu_seqlens_padded is None else batch.cu_seqlens_padded
    row = PackedRow.from_cu(offsets, None, int(batch.tokens.shape[-1]), batch.max_seqlen)
    if device is not None:
        offsets = offsets.to(device)
    extra = {"pad_between_seqs": False} if _HAS_PAD_BETWEEN_SEQS else {}
    return PackedRowParams(
        qkv_format="thd",
        cu_seqlens_q=offsets,
        cu_seqlens_kv=offsets,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=row.max_seqlen,
        max_seqlen_kv=row.max_seqlen,
        row=row,
        **extra,
    )


def _row_of(params, total: int) -> PackedRow:
    row = getattr(params, "row", None)
    if row is None:  # plain PackedSeqParams: read the offsets (a device sync on GPU)
        row = PackedRow.from_cu(params.cu_seqlens_q, params.cu_seqlens_q_padded, total, params.max_seqlen_q)
    elif row.total != total:
        raise ValueError(f"packed_seq_params describe a row of {row.total} tokens, attention got {total}")
    return row


# ------------------------------------------------------------------------ the three kernels


def _sdpa(q, k, v, *, causal, mask=None, scale, dropout_p):
    """q [.., np, s, hn], k/v [.., ng, s, hn] -> [.., np, s, hn]; GQA by head grouping."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=q.size(-3) != k.size(-3),
    )


def loop_attention(query, key, value, row: PackedRow, *, scale, dropout_p=0.0):
    """One causal SDPA per sequence: [t, np, hn] -> [t, np*hn], zeros on padding."""
    t, heads, hn = query.shape
    pieces, pos = [], 0
    for start, length in zip(row.starts, row.lengths):
        if start > pos:  # padding between sequences
            pieces.append(query.new_zeros(start - pos, heads, hn))
        q, k, v = (x[start : start + length].transpose(0, 1) for x in (query, key, value))
        out = _sdpa(q, k, v, causal=True, scale=scale, dropout_p=dropout_p)
        pieces.append(out.transpose(0, 1))
        pos = start + length
    if pos < t:
        pieces.append(query.new_zeros(t - pos, heads, hn))
    return torch.cat(pieces).reshape(t, heads * hn)


def bucketed_attention(query, key, value, row: PackedRow, *, scale, dropout_p=0.0, call_cost: float = BUCKET_CALL_COST):
    """One causal SDPA per bucket of similar lengths: [t, np, hn] -> [t, np*hn], zeros on padding.
    (Plain index_select both ways: custom autograd functions whose backward gathers instead of
    scatter-adding measured no faster on CPU, docs/packing.md.)"""
    t, heads, hn = query.shape
    plan = row.bucket_plan(query.device, call_cost / (heads * hn))
    if not plan.shapes:  # no tokens in any sequence
        return query.new_zeros(t, heads * hn)
    parts = [x.index_select(0, plan.gather).split(plan.sizes) for x in (query, key, value)]
    outs = []
    for b, (rows, width) in enumerate(plan.shapes):
        # splitting the token dim is a view; [rows, width, heads, hn] -> [rows, heads, width, hn]
        q, k, v = (x[b].unflatten(0, (rows, width)).transpose(1, 2) for x in parts)
        out = _sdpa(q, k, v, causal=True, scale=scale, dropout_p=dropout_p)
        outs.append(out.transpose(1, 2).reshape(rows * width, heads * hn))
    if plan.gaps:  # what tokens outside every sequence read
        outs.append(query.new_zeros(1, heads * hn))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, plan.inverse)


def varlen_attention(query, key, value, row: PackedRow, *, scale):
    """torch's varlen flash attention over the row's (padded) segments: [t, np, hn] -> [t, np*hn].
    A segment is its sequence then its padding, so under the causal window (-1, 0) real tokens
    never see padding; padding outputs are zeroed."""
    t, heads, hn = query.shape
    offsets, real = row.varlen_inputs(query.device)
    gqa = {}
    if heads != key.size(1):
        if VARLEN_HAS_GQA:
            gqa["enable_gqa"] = True
        else:
            group = heads // key.size(1)
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out = varlen_attn(
        query,
        key,
        value,
        offsets,
        offsets,
        row.max_seqlen,
        row.max_seqlen,
        scale=scale,
        window_size=(-1, 0),
        **gqa,
    )
    if real is not None:
        out = out.masked_fill(~real, 0.0)
    return out.reshape(t, heads * hn)


# ------------------------------------------------------------------------------ the module


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention whose forward also accepts packed_seq_params (qkv_format 'thd').
    thd_impl: model.thd_attention, given by the layer spec's params when the model is built."""

    def __init__(self, *args, thd_impl: str = "auto", **kwargs):
        if thd_impl not in THD_IMPLS:
            raise ValueError(f"config key 'model.thd_attention': expected one of {THD_IMPLS}, got {thd_impl!r}")
        super().__init__(*args, **kwargs)
        self.thd_impl = thd_impl

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        assert attention_bias is None, "attention_bias is not supported"
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # Dropout draws from the TP-rank-specific RNG stream, as Megatron's own attention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else nullcontext()
        with rng:
            if packed_seq_params is None:
                return self._forward_bshd(query, key, value, attention_mask, dropout_p)
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            row = _row_of(packed_seq_params, query.size(0))
            impl = choose_thd_impl(self.thd_impl, **_call_facts(query, dropout_p))
            if impl == "varlen":
                return varlen_attention(query, key, value, row, scale=self.softmax_scale)
            kernel = bucketed_attention if impl == "bucketed" else loop_attention
            return kernel(query, key, value, row, scale=self.softmax_scale, dropout_p=dropout_p)

    def _forward_bshd(self, query, key, value, attention_mask, dropout_p):
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if attention_mask is None:
            out = _sdpa(q, k, v, causal=True, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            # Megatron's convention: True = masked out (as in the local attention's softmax).
            out = _sdpa(
                q, k, v, causal=False, mask=~attention_mask.bool(), scale=self.softmax_scale, dropout_p=dropout_p
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
