"""Helpers shared by the torchrun worker scripts (test-only code).

Weights move between layouts through a "full" state dict: the TP=1, PP=1 model's parameters
under their global names. shard() cuts it for this rank using the attributes Megatron puts on
every tensor-parallel parameter (partition_dim, partition_stride), so the same weights can be
loaded at any TP/PP split, and local gradients can be compared with sharded reference ones.
"""

import os

import megatron_dppo.megatron  # noqa: F401  (before megatron.core: imports it without TorchInductor on CPU)

# isort: split
import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from transformers import Qwen3Config

VOCAB = 50  # padded by Megatron to 128 * tp


def tiny_config(**overrides) -> Qwen3Config:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def _global_name(model, name: str) -> str:
    """decoder.layers.<local i> -> decoder.layers.<global i>; a PP last stage's tied
    output_layer.weight is the embedding."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def _shard(param, full: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    tp, rank = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())
    size = param.shape[dim] * tp
    if full.shape[dim] != size:  # vocab padding differs between layouts: pad or cut rows
        full = full.narrow(dim, 0, min(size, full.shape[dim]))
        pad = list(full.shape)
        pad[dim] = size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim)
    chunks = torch.split(full, param.shape[dim] // stride, dim)
    return torch.cat(chunks[rank::tp], dim)


def shard(model, full: dict) -> dict:
    """{local name: this rank's piece of full[global name]} for every parameter of model."""
    return {n: _shard(p, full[_global_name(model, n)]) for n, p in model.named_parameters()}


def load_full(model, full: dict) -> None:
    pieces = shard(model, full)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(pieces[name])


def full_params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def finalize_grads(model) -> None:
    """What Megatron's finalize_model_grads (run by the DDP training step) adds to plain
    autograd gradients; tests without DDP do it here:
    - q/k_layernorm weights are replicated across TP but each rank only sees its own heads,
      so their gradients are partial sums over the TP group;
    - with tied embeddings and PP > 1 the first stage's embedding and the last stage's
      output_layer hold the same weight: its gradient is the sum of both."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        if ("q_layernorm" in name or "k_layernorm" in name) and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=tp_group)
    if model.share_embeddings_and_output_weights and (parallel_state.get_pipeline_model_parallel_world_size() > 1):
        weight = model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def pack(seqs, multiple=4):
    """THD micro-batch: one row, each sequence padded to a multiple; returns
    (input_ids [1, T], position_ids [1, T], labels [1, T], PackedSeqParams, starts)."""
    lens = [len(s) for s in seqs]
    padded = [-(-n // multiple) * multiple for n in lens]
    T = sum(padded)
    ids, pos, labels = (torch.zeros(1, T, dtype=torch.long) for _ in range(3))
    starts = [sum(padded[:i]) for i in range(len(seqs))]
    for s, start in zip(seqs, starts):
        n = len(s)
        ids[0, start : start + n] = s
        pos[0, start : start + n] = torch.arange(n)
        labels[0, start : start + n - 1] = s[1:]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_pad = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return ids, pos, labels, params, starts


def alone(seq):
    """(input_ids [1, n], position_ids [1, n], labels [1, n]) for one unpacked sequence."""
    n = len(seq)
    labels = torch.zeros(1, n, dtype=torch.long)
    labels[0, :-1] = seq[1:]
    return seq[None], torch.arange(n)[None], labels


def log(*args):
    if os.environ.get("RANK", "0") == "0":
        print(*args, flush=True)
