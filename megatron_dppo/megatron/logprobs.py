"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Layout: `logits` is this TP rank's vocab slice as GPTModel.forward(labels=None) returns it,
[b, s, V_pad / tp] (Megatron transposes [s, b] to [b, s] before returning); `labels` [b, s].
For a packed THD micro-batch b = 1 and s = the packed row.

`vocab_size` is the real (HF) vocabulary: Megatron pads the output layer to V_pad rows
(model.padded_vocab_size), and those extra logits must not take probability mass, or log-probs
differ from HF / vLLM (zero-initialised padding rows alone would add V_pad - V to the softmax
denominator's exp(0) terms). Labels outside [0, vocab_size) get -logsumexp (mask them yourself).
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)


def _scaled_masked_logits(logits, vocab_size: int, temperature: float):
    """fp32 logits / temperature with padding columns at -inf (always a new tensor)."""
    z = logits.float() / temperature
    part = z.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * part
    if start + part > vocab_size:
        padding = torch.arange(start, start + part, device=z.device) >= vocab_size
        z = z.masked_fill(padding, float("-inf"))
    return z


def token_logprobs(logits, labels, *, vocab_size: int, temperature: float = 1.0):
    """log p(labels) per token, [b, s] fp32, differentiable (logp = -vocab-parallel CE)."""
    z = _scaled_masked_logits(logits, vocab_size, temperature)
    # vocab_parallel_cross_entropy works in place on its input: z is ours to spend.
    return -vocab_parallel_cross_entropy(z, labels)


def token_logprobs_and_entropy(logits, labels, *, vocab_size: int, temperature: float = 1.0):
    """(log p(labels), entropy of the full next-token distribution), both [b, s] fp32 and
    differentiable; the entropy's sums run over the TP group (all-reduces of [b, s] tensors)."""
    z = _scaled_masked_logits(logits, vocab_size, temperature)
    logp = -vocab_parallel_cross_entropy(z.clone(), labels)  # clone: CE overwrites its input
    return logp, _entropy(z)


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
def entropy_sum(logits, mask, *, vocab_size: int, temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """Sum of the next-token entropies at the positions where mask [b, s] is set (fp64 scalar),
    computed `chunk` positions at a time so the fp32 copy of the vocabulary slice stays small
    (1024 x 151936 / tp floats at most) beside the training forward's own logits."""
    rows = logits.detach().reshape(-1, logits.size(-1))[mask.flatten().to(logits.device)]
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    n_chunks = -(-rows.size(0) // chunk)
    # Every TP rank runs the same number of all-reduces: they hold the same positions.
    for i in range(n_chunks):
        z = _scaled_masked_logits(rows[i * chunk : (i + 1) * chunk], vocab_size, temperature)
        total += _entropy(z).double().sum()
    return total
