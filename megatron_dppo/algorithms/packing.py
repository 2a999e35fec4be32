"""Dense Prompt Packing (docs/dppo.md section 6): sequences -> micro-batches -> THD batches.

Three stages, all plain python/torch (nothing here imports Megatron: the THD batch becomes
Megatron's PackedSeqParams in megatron_dppo.megatron.attention.packed_seq_params):

1. `pack` puts sequence indices into packs of at most `capacity` tokens with the window
   greedy: arrival order is kept, and among the next `window` unplaced sequences the longest
   that still fits goes into the open pack. `pack_ffd` (first-fit-decreasing) and
   `pack_padded` (plain padded batching) are the baselines; `density` compares them.
2. `balance_packs` spreads packs over data-parallel ranks: equal micro-batch count per rank
   (the pipeline schedule needs it), balanced estimated compute.
3. `build_thd_batch` turns one pack into a THD batch (one row, sequences concatenated, per
   sequence padding to a multiple of tp*2*cp) for Transformer Engine's fused attention;
   `build_padded_batch` is the [rows, L] baseline with the same fields.

Lengths given to the packers are whatever the micro-batch will hold: when THD padding is on
(pad_multiple > 1) pass `round_up(len, pad_multiple)` so a built batch never exceeds capacity.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# 1. packing


def _check_lengths(lengths, capacity: int, allow_oversize: bool = False) -> list[int]:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
        raise ValueError(f"capacity (max_tokens_per_microbatch) must be a positive int, got {capacity!r}")
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    lengths = [int(x) for x in lengths]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        if n > capacity and not allow_oversize:
            raise ValueError(
                f"sequence {i} has length {n} > capacity {capacity} (max_tokens_per_microbatch): "
                f"raise the capacity or lower the max prompt/response length "
                f"(or pack with allow_oversize=True to give it its own micro-batch)"
            )
    return lengths


def pack(lengths, capacity: int, window: int = 64, *, allow_oversize: bool = False) -> list[list[int]]:
    """Window greedy (docs/dppo.md section 6) -> list of packs, each a list of indices into `lengths`.

    Keeps arrival order (a prompt's completions stay close): the window is always the first
    `window` unplaced sequences; the open pack takes the LONGEST of them that fits (ties: the
    earliest); when none fits the pack is closed and a new one opened. window=1 is next-fit in
    arrival order; window >= len(lengths) gives exactly `pack_ffd`'s packs (FFD fills its bins
    in the same order, see tests). Indices inside a pack are sorted (arrival order).

    The window is kept sorted by (length, -index), so each placement is one bisect:
    O(N log W) python steps (plus O(W) memmoves), fast even for window = N = 10k.
    With allow_oversize=True a sequence longer than capacity gets a pack of its own,
    appended after the regular packs; otherwise it is a ValueError naming it.
    """
    lengths = _check_lengths(lengths, capacity, allow_oversize)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    n = len(lengths)
    stream = [i for i in range(n) if lengths[i] <= capacity]
    oversize = [[i] for i in range(n) if lengths[i] > capacity]

    # One int per sequence orders the window by length, then by EARLIER index first:
    # key = len * n + (n - 1 - i); the largest key <= room * n + n - 1 is the longest that fits.
    def key(i):
        return lengths[i] * n + (n - 1 - i)

    win = sorted(key(i) for i in stream[:window])
    nxt = len(win)
    packs, cur, room = [], [], capacity
    while win:
        j = bisect_right(win, room * n + n - 1) - 1
        if j < 0:  # nothing in the window fits: close the pack (never empty: all fit alone)
            packs.append(sorted(cur))
            cur, room = [], capacity
            continue
        i = n - 1 - win.pop(j) % n
        cur.append(i)
        room -= lengths[i]
        if nxt < len(stream):  # the next arrival slides into the window
            insort(win, key(stream[nxt]))
            nxt += 1
    if cur:
        packs.append(sorted(cur))
    return packs + oversize


def pack_ffd(lengths, capacity: int) -> list[list[int]]:
    """First-fit-decreasing baseline: longest first (ties: arrival order), each into the first
    pack with room. Whole-batch reordering, so no locality; the density reference."""
    lengths = _check_lengths(lengths, capacity)
    room = np.empty(len(lengths), dtype=np.int64)  # free tokens of each open pack
    packs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable sort
        n = lengths[i]
        fits = room[: len(packs)] >= n
        j = int(fits.argmax()) if packs else 0
        if packs and fits[j]:
            packs[j].append(i)
            room[j] -= n
        else:
            packs.append([i])
            room[len(packs) - 1] = capacity - n
    return [sorted(p) for p in packs]


def pack_padded(lengths, capacity: int, *, per_microbatch: bool = False) -> list[list[int]]:
    """Plain padded batching baseline: arrival order, every row padded to the longest sequence
    of the batch, as many rows per micro-batch as fit (rows * max_len <= capacity).

    per_microbatch=True pads each micro-batch only to its own longest row (dynamic padding,
    a stronger baseline): a row joins while (rows + 1) * max(max_len, len) <= capacity.
    """
    lengths = _check_lengths(lengths, capacity)
    n = len(lengths)
    if not per_microbatch:
        longest = max(lengths, default=0)
        rows = capacity // longest if longest else max(n, 1)
        return [list(range(s, min(s + rows, n))) for s in range(0, n, rows)]
    packs, cur, longest = [], [], 0
    for i, length in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, length) > capacity:
            packs.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, length)
    return packs + ([cur] if cur else [])


def density(lengths, packs, capacity: int) -> float:
    """Real tokens / (micro-batches * capacity): the fraction of micro-batch slots doing work."""
    if not packs:
        return 0.0
    return sum(int(lengths[i]) for p in packs for i in p) / (len(packs) * capacity)


# ----------------------------------------------------------------------------------------------
# 2. data-parallel balancing


def attn_coef_for(hidden_size: int) -> float:
    """Cost of a sequence of L tokens ~ L + c * L^2 (units: one token through the linear layers).

    Per layer forward a token costs 24 h^2 FLOPs in the linear layers (QKV+out 8h^2, 4h MLP
    16h^2); causal attention costs 2 h L^2 per sequence (QK^T and AV, 4hL^2, half masked).
    So c = 2h / 24h^2 = 1 / (12 h). GQA/SwiGLU shift it a little; it only steers balancing.
    """
    return 1.0 / (12 * hidden_size)


DEFAULT_ATTN_COEF = attn_coef_for(4096)  # ~2e-5: attention is ~4% of a 2k-token sequence


def pack_cost(pack: Sequence[int], lengths, attn_coef: float = DEFAULT_ATTN_COEF) -> float:
    """Estimated compute of one micro-batch: sum L + attn_coef * sum L^2 (attention never
    crosses a sequence boundary, so the quadratic term is per sequence)."""
    return float(sum(int(lengths[i]) + attn_coef * int(lengths[i]) ** 2 for i in pack))


def _split(pack: list[int], lengths, attn_coef: float) -> tuple[list[int], list[int]]:
    """Re-pack one pack into two halves of similar cost (longest first into the lighter half).
    Each half is a subset of a pack that fit, so it fits too."""
    halves, costs = ([], []), [0.0, 0.0]
    for i in sorted(pack, key=lambda i: -lengths[i]):
        h = 0 if costs[0] <= costs[1] else 1
        halves[h].append(i)
        costs[h] += pack_cost([i], lengths, attn_coef)
    return sorted(halves[0]), sorted(halves[1])


def balance_packs(packs, lengths, dp_size: int, attn_coef: float = DEFAULT_ATTN_COEF) -> list[list[list[int]]]:
    """Spread packs over `dp_size` data-parallel ranks -> per rank, a list of packs.

    Every rank gets the SAME number of micro-batches M = ceil(len(packs) / dp_size): the
    pipeline schedule and the gradient all-reduce need each rank to step the same count.
    To reach M * dp_size packs the heaviest pack (by `pack_cost`) is split in two, repeatedly,
    rather than adding idle micro-batches. Only when there are fewer sequences than
    M * dp_size slots (e.g. fewer sequences than ranks) are empty packs ([]) added; the trainer
    must still run one (dummy, zero-loss) forward/backward for them.
    Packs then go heaviest first to the least-loaded rank that still has a free slot (LPT with
    a cardinality limit); each rank's packs are in arrival order. `dp_imbalance` measures it.
    Empty input packs are dropped; no packs at all gives every rank zero micro-batches.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if attn_coef < 0:
        raise ValueError(f"attn_coef must be >= 0, got {attn_coef!r}")
    packs = [sorted(p) for p in packs if len(p)]
    if not packs:
        return [[] for _ in range(dp_size)]
    per_rank = math.ceil(len(packs) / dp_size)
    missing = per_rank * dp_size - len(packs)

    # Split the heaviest splittable pack until the count is a multiple of dp_size.
    heap = [(-pack_cost(p, lengths, attn_coef), k) for k, p in enumerate(packs) if len(p) > 1]
    heapq.heapify(heap)
    while missing and heap:
        _, k = heapq.heappop(heap)
        a, b = _split(packs[k], lengths, attn_coef)
        packs[k] = a
        packs.append(b)
        for j in (k, len(packs) - 1):
            if len(packs[j]) > 1:
                heapq.heappush(heap, (-pack_cost(packs[j], lengths, attn_coef), j))
        missing -= 1
    packs += [[] for _ in range(missing)]  # only when every pack is a single sequence

    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    loads = [(0.0, r) for r in range(dp_size)]  # (cost so far, rank): a min-heap
    for p in sorted(packs, key=lambda p: -pack_cost(p, lengths, attn_coef)):
        load, r = heapq.heappop(loads)
        ranks[r].append(p)
        if len(ranks[r]) < per_rank:  # a full rank leaves the heap
            heapq.heappush(loads, (load + pack_cost(p, lengths, attn_coef), r))
    for r in ranks:
        r.sort(key=lambda p: p[0] if p else math.inf)
    return ranks


def dp_imbalance(rank_packs, lengths, attn_coef: float = DEFAULT_ATTN_COEF) -> float:
    """max / mean of the per-rank estimated cost (1.0 = perfect; the step waits for the max)."""
    costs = [sum(pack_cost(p, lengths, attn_coef) for p in packs) for packs in rank_packs]
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0


# ----------------------------------------------------------------------------------------------
# 3. THD (and padded) batches


@dataclass(frozen=True)
class PackLayout:
    """How this rank packs: trainer.packing / max_tokens_per_microbatch / pack_window, the THD pad
    multiple (TP, sequence parallel), its data-parallel place, and whether the policy runs the
    local (non-TE) attention."""

    kind: str
    capacity: int
    window: int
    pad_multiple: int
    pad_id: int
    dp_rank: int
    dp_size: int
    local_attention: bool


@dataclass
class Sample:
    """One retained sequence of the rollout batch: prompt + completion token ids."""

    tokens: Sequence[int] | torch.Tensor
    prompt_len: int
    advantage: float = 0.0
    weight: float = 1.0  # DPPO weight w_q * w_o
    seq_id: int = 0  # its row in the rollout batch
    old_logp: torch.Tensor | None = None  # [len - prompt_len], one per completion token
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None  # the sampling engine's log-probs of the completion
    # rollout.routing_replay: [len(tokens), layers, top-k] experts each position was routed to (sample_routing)
    routed_experts: torch.Tensor | None = None
    # Which completion tokens carry loss (1) and which do not (0): BPPO's prefix, DAPO's overlong
    # filter. None: all of them. A sequence's "length" in the aggregations is its loss tokens.
    loss_mask: Sequence[float] | None = None


@dataclass
class AuxRows:
    """SSOPD's teacher/student pairs inside a packed micro-batch (algorithms/methods/ssopd/distill.py): for each
    distilled position, the logit row of the teacher's and of the student's prediction of the same
    token of o_w*, that token, and its coefficient lambda * w_q * omega_q / (B * T_q)."""

    teacher_rows: torch.Tensor  # [N] int64, positions in the packed row
    student_rows: torch.Tensor  # [N] int64
    targets: torch.Tensor  # [N] int64
    coef: torch.Tensor  # [N] float64


@dataclass
class ThdBatch:
    """A micro-batch. Packed (THD): every [1, T_pad] tensor is one row holding S sequences;
    sequence i occupies [cu_seqlens_padded[i], cu_seqlens_padded[i] + real_len_i), followed by
    its padding up to cu_seqlens_padded[i+1]. Padded baseline: [S, L] tensors, row i is
    sequence i, right-padded, cu_seqlens* None (plain causal attention over each row: the
    padding comes after the real tokens, so no extra mask is needed).

    Per position t: labels[t] is the next token of the same sequence (0 where there is none);
    loss_mask[t] = 1 exactly when labels[t] is a completion token that carries loss (the
    sample's loss_mask; all completion tokens by default); advantages, old_logp, ref_logp and
    rollout_logp are aligned to the completion's label positions (0 elsewhere). position_ids restart at 0 for
    each sequence and simply continue counting through its padding (keeps RoPE in range and
    the padded segment looks like one longer sequence to TE). seq_index is -1 on padding.
    """

    tokens: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64
    labels: torch.Tensor  # int64
    loss_mask: torch.Tensor  # float32
    seq_index: torch.Tensor  # int64, 0..S-1, -1 on padding
    advantages: torch.Tensor  # float32
    seq_weight: torch.Tensor  # [S] float32
    seq_len: torch.Tensor  # [S] int64, loss tokens of each sequence (its completion, unless masked)
    seq_ids: torch.Tensor  # [S] int64, rows in the rollout batch
    cu_seqlens: torch.Tensor | None = None  # [S+1] int32, over real lengths
    cu_seqlens_padded: torch.Tensor | None = None  # [S+1] int32, over padded lengths
    max_seqlen: int = 0  # longest PADDED sequence (TE sizes its kernels by the padded
    # layout); padded baseline: the row length L
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    # rollout.routing_replay: [rows, row_len, layers, top-k] int32, each position's experts (arange(k)
    # on padding); Megatron's routers replay them (megatron/routing_replay.py)
    routed_experts: torch.Tensor | None = None
    token_scale: torch.Tensor | None = None  # ReCo's c_t at each loss position (set after the pi_old pass)
    aux: AuxRows | None = None  # SSOPD pairs: this micro-batch carries the auxiliary loss, not GRPO's

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def to(self, device) -> ThdBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[k] = v.to(device)
        return ThdBatch(**moved)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def thd_pad_multiple(tp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Per-sequence length multiple THD needs: 2*cp (context parallel splits each sequence into
    2*cp chunks for load balance) times tp when sequence parallel splits tokens over TP ranks."""
    return (tp_size if sequence_parallel else 1) * (2 * cp_size if cp_size > 1 else 1)


def _as_sample(s, k: int) -> Sample:
    s = Sample(**s) if isinstance(s, Mapping) else s
    n = len(s.tokens)
    if not 1 <= s.prompt_len <= n:
        raise ValueError(f"sample {k}: prompt_len must be in [1, len(tokens)={n}], got {s.prompt_len}")
    for name in _PER_COMPLETION_TOKEN + ("loss_mask",):
        v = getattr(s, name)
        if v is not None and len(v) != n - s.prompt_len:
            raise ValueError(
                f"sample {k}: {name} has {len(v)} values, expected one per completion "
                f"token ({n} - {s.prompt_len} = {n - s.prompt_len})"
            )
    if s.routed_experts is not None and len(s.routed_experts) != n:
        raise ValueError(f"sample {k}: routed_experts has {len(s.routed_experts)} rows, expected one per token ({n})")
    return s


_PER_COMPLETION_TOKEN = ("old_logp", "ref_logp", "rollout_logp")  # optional, aligned like advantages


def sample_routing(routed, n_tokens: int) -> torch.Tensor:
    """A completion's routed experts from vLLM ([forwarded positions, layers, top-k]) as the
    [n_tokens, layers, top-k] int32 rows of its sample: cut to the sample's tokens (a BPPO prefix
    trains fewer), and a row for each position vLLM never forwarded (the last sampled token:
    no label, so no loss reads its routing) routed to experts 0..k-1."""
    r = torch.as_tensor(routed).to(torch.int32)
    if r.dim() != 3 or r.shape[0] < n_tokens - 1:
        raise ValueError(
            f"routed experts of shape {tuple(r.shape)}: expected [positions, layers, top-k] with at least "
            f"{n_tokens - 1} positions (the sample's tokens but the last)"
        )
    r = r[:n_tokens]
    missing = n_tokens - r.shape[0]
    if missing:
        fill = torch.arange(r.shape[2], dtype=torch.int32).expand(missing, r.shape[1], r.shape[2])
        r = torch.cat([r, fill])
    return r


def _build(samples, rows: int, row_len: int, pad_id: int, segment):
    """Allocate [rows, row_len] buffers and fill each sample into the 1-D view segment(buf, i)."""
    opt = {}
    for name in _PER_COMPLETION_TOKEN:
        have = [getattr(s, name) is not None for s in samples]
        if any(have) and not all(have):
            raise ValueError(f"{name} must be given for all samples or for none")
        opt[name] = torch.zeros(rows, row_len) if samples and all(have) else None
    routed = _routing_buffer(samples, rows, row_len)
    b = dict(
        tokens=torch.full((rows, row_len), pad_id, dtype=torch.long),
        position_ids=torch.zeros(rows, row_len, dtype=torch.long),
        labels=torch.zeros(rows, row_len, dtype=torch.long),
        loss_mask=torch.zeros(rows, row_len),
        seq_index=torch.full((rows, row_len), -1, dtype=torch.long),
        advantages=torch.zeros(rows, row_len),
    )
    for i, s in enumerate(samples):
        ids = torch.as_tensor(s.tokens, dtype=torch.long)
        n, p0 = len(ids), s.prompt_len
        v = {k: segment(t, i) for k, t in b.items()}
        v["tokens"][:n] = ids
        v["position_ids"][:] = torch.arange(len(v["position_ids"]))
        v["labels"][: n - 1] = ids[1:]
        v["seq_index"][:n] = i
        # positions p0-1 .. n-2 predict the completion tokens p0 .. n-1
        v["loss_mask"][p0 - 1 : n - 1] = 1.0 if s.loss_mask is None else torch.as_tensor(s.loss_mask).float()
        v["advantages"][p0 - 1 : n - 1] = float(s.advantage)
        for name, t in opt.items():
            if t is not None:
                segment(t, i)[p0 - 1 : n - 1] = torch.as_tensor(getattr(s, name), dtype=torch.float32)
        if routed is not None:
            segment(routed, i)[:n] = s.routed_experts
    return dict(
        **b,
        **opt,
        routed_experts=routed,
        seq_weight=torch.tensor([float(s.weight) for s in samples], dtype=torch.float32),
        seq_len=torch.tensor([_loss_tokens(s) for s in samples], dtype=torch.long),
        seq_ids=torch.tensor([int(s.seq_id) for s in samples], dtype=torch.long),
    )


def _routing_buffer(samples, rows: int, row_len: int) -> torch.Tensor | None:
    """[rows, row_len, layers, top-k] int32 for the samples' routed experts, every position routed to
    experts 0..k-1 until filled (padding's routing changes no real token); None without them."""
    have = [s.routed_experts is not None for s in samples]
    if not samples or not any(have):
        return None
    if not all(have):
        raise ValueError("routed_experts must be given for all samples or for none")
    shapes = {tuple(s.routed_experts.shape[1:]) for s in samples}
    if len(shapes) != 1:
        raise ValueError(f"routed_experts: the samples' [layers, top-k] differ: {sorted(shapes)}")
    (layers, k) = shapes.pop()
    return torch.arange(k, dtype=torch.int32).expand(rows, row_len, layers, k).clone()


def _loss_tokens(s: Sample) -> int:
    n = len(s.tokens) - s.prompt_len
    return n if s.loss_mask is None else int(sum(1 for m in s.loss_mask if m > 0))


def build_thd_batch(samples, pad_multiple: int = 1, pad_id: int = 0) -> ThdBatch:
    """One pack -> a packed THD batch ([1, T_pad] tensors).

    Each sequence is padded to a multiple of `pad_multiple` (see thd_pad_multiple; 1 = no
    padding), so T_pad = cu_seqlens_padded[-1]. `samples` are Sample objects or dicts with the
    same keys. An empty list gives an empty [1, 0] batch.
    """
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
    samples = [_as_sample(s, k) for k, s in enumerate(samples)]
    real = [len(s.tokens) for s in samples]
    padded = [round_up(n, pad_multiple) for n in real]
    starts = [0]
    for p in padded:
        starts.append(starts[-1] + p)
    b = _build(samples, 1, starts[-1], pad_id, lambda t, i: t[0, starts[i] : starts[i + 1]])
    return ThdBatch(
        **b,
        cu_seqlens=torch.tensor([0] + real, dtype=torch.int64).cumsum(0).to(torch.int32),
        cu_seqlens_padded=torch.tensor(starts, dtype=torch.int32),
        max_seqlen=max(padded, default=0),
    )


def build_padded_batch(samples, pad_multiple: int = 1, pad_id: int = 0, row_len: int | None = None) -> ThdBatch:
    """Baseline: one row per sequence, [S, L] tensors, L = longest sequence rounded up to
    `pad_multiple` (or `row_len` if given). cu_seqlens* are None; attention is per row."""
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an int >= 1, got {pad_multiple!r}")
    samples = [_as_sample(s, k) for k, s in enumerate(samples)]
    longest = max((len(s.tokens) for s in samples), default=0)
    L = round_up(longest, pad_multiple) if row_len is None else row_len
    if L < longest:
        raise ValueError(f"row_len {L} is shorter than the longest sequence ({longest})")
    b = _build(samples, len(samples), L, pad_id, lambda t, i: t[i])
    return ThdBatch(**b, max_seqlen=L)
