"""Core attention for Megatron-Core's local layer spec that understands packed (THD) batches.

Megatron's local DotProductAttention refuses packed_seq_params, and no public Megatron-Core
backend does varlen attention without Transformer Engine. This module runs causal attention per
packed sequence with torch's scaled_dot_product_attention, so it works on CPU and on a GPU
without TE. It is a drop-in `core_attention` for get_gpt_layer_local_spec (same constructor).

Layouts Megatron-Core 0.16 hands to core_attention (transformer/attention.py):
  plain:  query [s, b, np, hn], key/value [s, b, ng, hn]  ->  returns [s, b, np*hn]
  packed: query [t, np, hn],    key/value [t, ng, hn]     ->  returns [t, np*hn]
          (SelfAttention squeezes the dummy batch dim before and restores it after)
np / ng are this TP rank's query heads / KV groups (GQA when np > ng).

Packed layout: sequence i occupies tokens [cu_seqlens_q_padded[i], + len_i) of the row, where
len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]; tokens after it up to the next padded offset are
padding: nobody attends to them and their outputs are zero. RoPE positions restart at each
padded offset (Megatron's _apply_rotary_pos_emb_thd), so real tokens get positions 0..len_i-1.
That RoPE also constrains the batch (measured; it fails otherwise): max_seqlen_q must be at
least the longest PADDED segment, and cu_seqlens_q_padded[-1] must equal the row length (put
any tail padding into the last segment).
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention


def _sdpa(q, k, v, *, causal, mask=None, scale, dropout_p):
    """q [.., np, s, hn], k/v [.., ng, s, hn] -> [.., np, s, hn]; GQA by head grouping."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.size(-3) != k.size(-3),
    )


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention whose forward also accepts packed_seq_params (qkv_format 'thd')."""

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
            return self._forward_thd(query, key, value, packed_seq_params, dropout_p)

    def _forward_bshd(self, query, key, value, attention_mask, dropout_p):
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if attention_mask is None:
            out = _sdpa(q, k, v, causal=True, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            # Megatron's convention: True = masked out (as in the local attention's softmax).
            out = _sdpa(q, k, v, causal=False, mask=~attention_mask.bool(),
                        scale=self.softmax_scale, dropout_p=dropout_p)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_thd(self, query, key, value, params, dropout_p):
        cu = params.cu_seqlens_q.tolist()
        starts = (cu if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded.tolist())
        t, heads, hn = query.shape
        pieces, pos = [], 0
        for i in range(len(cu) - 1):
            start, length = starts[i], cu[i + 1] - cu[i]
            assert start >= pos and start + length <= t, "cu_seqlens do not fit the packed row"
            if start > pos:  # padding between sequences
                pieces.append(query.new_zeros(start - pos, heads, hn))
            q, k, v = (x[start : start + length].transpose(0, 1) for x in (query, key, value))
            out = _sdpa(q, k, v, causal=True, scale=self.softmax_scale, dropout_p=dropout_p)
            pieces.append(out.transpose(0, 1))
            pos = start + length
        if pos < t:
            pieces.append(query.new_zeros(t - pos, heads, hn))
        return torch.cat(pieces).reshape(t, heads * hn)
