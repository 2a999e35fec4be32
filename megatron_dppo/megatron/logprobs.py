"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Layout: `logits` is this TP rank's vocab slice as GPTModel.forward(labels=None) returns it,
[b, s, V_pad / tp] (Megatron transposes [s, b] to [b, s] before returning); `labels` [b, s].
For a packed THD micro-batch b = 1 and s = the packed row.

`vocab_size` is the real (HF) vocabulary: Megatron pads the output layer to V_pad rows
(model.padded_vocab_size), and those extra logits must not take probability mass, or log-probs
differ from HF / vLLM (zero-initialised padding rows alone would add V_pad - V to the softmax
denominator's exp(0) terms). Labels outside [0, vocab_size) get -logsumexp (mask them yourself).

Memory: the log-probs run over CHUNK_ELEMENTS-sized blocks of positions, so no fp32 copy of the
whole logits is ever made (at 8192 x 151,936 one is 4.6 GiB). The forward keeps each position's
max and sum of exponentials; the backward recomputes a block's softmax from the logits and writes
its gradient into one buffer of the logits' dtype. Peak beyond the model's logits: that gradient
buffer plus a few fp32 blocks (docs/scaling.md, plan.py's logits row).
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

# fp32 elements of one block of positions (128 MiB): 220 positions of a 151,936 vocabulary at
# TP=1; a small vocabulary fits a whole micro-batch in one block.
CHUNK_ELEMENTS = 1 << 25
# The entropy sum adds its fp64 partial sums 1024 positions at a time, as it always has: the
# main job's entropy metric stays the same number.
ENTROPY_SUM_CHUNK = 1024


def chunk_positions(partition_vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Positions per block for a vocab slice of `partition_vocab` columns."""
    return max(1, chunk_elements // partition_vocab)


def _scaled_masked_logits(logits, vocab_size: int, temperature: float):
    """fp32 logits / temperature with padding columns at -inf (always a new tensor)."""
    z = logits.float() / temperature
    padding = _padding_columns(z.size(-1), vocab_size, z.device)
    return z if padding is None else z.masked_fill(padding, float("-inf"))


def _padding_columns(part: int, vocab_size: int, device):
    """Boolean [part] mask of this TP rank's columns past the real vocabulary (None if none)."""
    start = parallel_state.get_tensor_model_parallel_rank() * part
    if start + part <= vocab_size:
        return None
    return torch.arange(start, start + part, device=device) >= vocab_size


def _local_targets(labels, part: int):
    """(labels outside this rank's columns, labels as local column indices, 0 where outside):
    vocab_parallel_cross_entropy's masking."""
    start = parallel_state.get_tensor_model_parallel_rank() * part
    outside = (labels < start) | (labels >= start + part)
    return outside, (labels - start).masked_fill(outside, 0)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(labels) of rows [N, V/tp], one block of positions at a time. Within a block the
    arithmetic is Megatron's vocab_parallel_cross_entropy's (its VocabParallelCrossEntropy
    steps, the same all-reduces), so values and gradients are those of
    -vocab_parallel_cross_entropy(_scaled_masked_logits(rows)) position by position.
    want_entropy: also each position's entropy (no gradient), from the same block."""

    @staticmethod
    def forward(ctx, rows, labels, vocab_size, temperature, block, want_entropy):
        group = parallel_state.get_tensor_model_parallel_group()
        part, n = rows.size(-1), rows.size(0)
        start = parallel_state.get_tensor_model_parallel_rank() * part
        logp = torch.empty(n, dtype=torch.float32, device=rows.device)
        row_max, sum_exp = torch.empty_like(logp), torch.empty_like(logp)
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=rows.device)
        for lo in range(0, n, block):
            sl = slice(lo, lo + block)
            z = _scaled_masked_logits(rows[sl], vocab_size, temperature)
            if want_entropy:
                entropy[sl] = _entropy(z)
            z, zmax = VocabParallelCrossEntropy.calculate_logits_max(z)
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
            _, _, predicted, s, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
                z, labels[sl], zmax, start, start + part
            )
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(s, group=group)
            logp[sl] = -(torch.log(s) - predicted)
            row_max[sl], sum_exp[sl] = zmax, s
        ctx.save_for_backward(rows, labels, row_max, sum_exp)
        ctx.vocab_size, ctx.temperature, ctx.block = vocab_size, temperature, block
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        rows, labels, row_max, sum_exp = ctx.saved_tensors
        part = rows.size(-1)
        padding = _padding_columns(part, ctx.vocab_size, rows.device)
        grad = torch.empty_like(rows)
        for lo in range(0, rows.size(0), ctx.block):
            sl = slice(lo, lo + ctx.block)
            softmax = _scaled_masked_logits(rows[sl], ctx.vocab_size, ctx.temperature)
            softmax -= row_max[sl].unsqueeze(-1)
            torch.exp(softmax, out=softmax)
            softmax.div_(sum_exp[sl].unsqueeze(-1))
            outside, local = _local_targets(labels[sl], part)
            g2d, arange, update, g = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, outside)
            # logp = -CE: CE's output gradient is -grad_logp
            g = VocabParallelCrossEntropy.calculate_gradients(g2d, arange, local, update, g, -grad_logp[sl])
            # then the backward of the -inf fill, of / temperature and of .float(), in that order
            if padding is not None:
                g.masked_fill_(padding, 0.0)
            grad[sl] = g.div_(ctx.temperature)
        return grad, None, None, None, None, None


def _chunked(logits, labels, vocab_size, temperature, want_entropy, chunk_elements):
    part = logits.size(-1)
    logp, entropy = _ChunkedTokenLogprobs.apply(
        logits.reshape(-1, part),
        labels.reshape(-1),
        vocab_size,
        temperature,
        chunk_positions(part, chunk_elements),
        want_entropy,
    )
    shape = labels.shape
    return logp.view(shape), (entropy.view(shape) if want_entropy else None)


def token_logprobs(logits, labels, *, vocab_size: int, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS):
    """log p(labels) per token, [b, s] fp32, differentiable (logp = -vocab-parallel CE)."""
    return _chunked(logits, labels, vocab_size, temperature, False, chunk_elements)[0]


def token_logprobs_detached_entropy(
    logits, labels, *, vocab_size: int, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS
):
    """(log p(labels) differentiable, the next-token entropy without gradient), both [b, s] fp32,
    from one pass over the logits (the loss's log-probs and its entropy metric)."""
    return _chunked(logits, labels, vocab_size, temperature, True, chunk_elements)


def token_logprobs_and_entropy(logits, labels, *, vocab_size: int, temperature: float = 1.0):
    """(log p(labels), entropy of the full next-token distribution), both [b, s] fp32 and
    differentiable; the entropy's sums run over the TP group (all-reduces of [b, s] tensors).
    The differentiable entropy keeps one fp32 copy of the logits (the log-probs none)."""
    logp = token_logprobs(logits, labels, vocab_size=vocab_size, temperature=temperature)
    return logp, _entropy(_scaled_masked_logits(logits, vocab_size, temperature))


def _entropy(z):
    """Entropy of softmax(z) over the TP-split last dim (z: scaled, padding at -inf)."""
    group = parallel_state.get_tensor_model_parallel_group()
    zmax = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)  # for stability only: no grad
    exp = torch.exp(z - zmax)
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1, keepdim=True))
    p = exp / sum_exp
    # H = log Z - sum_v p_v z_v; padding columns have p = 0 and z = -inf: count them as 0.
    pz = reduce_from_tensor_model_parallel_region((p * z.masked_fill(p == 0, 0.0)).sum(dim=-1))
    return torch.log(sum_exp.squeeze(-1)) + zmax.squeeze(-1) - pz


@torch.no_grad()
def entropy_sum(entropy, index) -> torch.Tensor:
    """Sum (fp64 scalar) of the per-position entropies `entropy` [b, s] at the flat positions
    `index` (an index tensor on entropy's device: no boolean mask, no host sync)."""
    picked = entropy.detach().flatten().index_select(0, index)
    total = torch.zeros((), dtype=torch.float64, device=entropy.device)
    for lo in range(0, picked.numel(), ENTROPY_SUM_CHUNK):
        total += picked[lo : lo + ENTROPY_SUM_CHUNK].double().sum()
    return total
