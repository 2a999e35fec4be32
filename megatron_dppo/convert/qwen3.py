"""Qwen3 HF <-> Megatron-Core GPTModel weight mapping, with TP and PP sharding.

Plain torch on state dicts (no megatron import), so the conversion tools, the trainer's weight
push to vLLM and the tests share one mapping. Names (measured, PLATFORM.md):

  model.embed_tokens.weight                 embedding.word_embeddings.weight   (vocab padded)
  model.layers.L.input_layernorm.weight     decoder.layers.L.input_layernorm.weight
                                            (TE spec: ...self_attention.linear_qkv.layer_norm_weight)
  model.layers.L.self_attn.{q,k,v}_proj     decoder.layers.L.self_attention.linear_qkv.weight
  model.layers.L.self_attn.{q,k}_norm       decoder.layers.L.self_attention.{q,k}_layernorm.weight
  model.layers.L.self_attn.o_proj           decoder.layers.L.self_attention.linear_proj.weight
  model.layers.L.post_attention_layernorm   decoder.layers.L.pre_mlp_layernorm.weight
                                            (TE spec: ...mlp.linear_fc1.layer_norm_weight)
  model.layers.L.mlp.{gate,up}_proj         decoder.layers.L.mlp.linear_fc1.weight (gate rows, up rows)
  model.layers.L.mlp.down_proj              decoder.layers.L.mlp.linear_fc2.weight
  model.norm.weight                         decoder.final_layernorm.weight
  lm_head.weight                            output_layer.weight (absent when tied)

The fused QKV rows are grouped per KV head: for each group g, its nq/ng query heads, then k
head g, then v head g. A TP rank owns whole groups, so a TP split of linear_qkv is a plain split
of dim 0; linear_fc1 must be split gate and up separately.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class Qwen3Layout:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    padded_vocab: int
    tied: bool
    te_names: bool = False  # Transformer Engine spec fuses the pre-norms into the linears

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def layout_from_hf_config(hf_config, padded_vocab: int | None = None, te_names: bool = False) -> Qwen3Layout:
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"config.json architectures={archs}: only {SUPPORTED_ARCHITECTURES} is supported "
                         "(Qwen2.5 adds q/k/v biases and has no qk-norm; Llama 3 has no qk-norm: not yet mapped)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return Qwen3Layout(
        num_layers=hf_config.num_hidden_layers, hidden=hf_config.hidden_size,
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim, intermediate=hf_config.intermediate_size, vocab=hf_config.vocab_size,
        padded_vocab=padded_vocab or hf_config.vocab_size, tied=bool(hf_config.tie_word_embeddings),
        te_names=te_names)


# ---------------------------------------------------------------------------------------------
# Full (unsharded) state dicts, global layer numbering.

def _mg_norm_names(layout: Qwen3Layout, i: int):
    p = f"decoder.layers.{i}."
    if layout.te_names:
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Qwen3Layout) -> torch.Tensor:
    ng, hpg, d = layout.num_kv_heads, layout.heads_per_group, layout.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, hpg * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (hpg + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, layout: Qwen3Layout):
    ng, hpg, d = layout.num_kv_heads, layout.heads_per_group, layout.head_dim
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (hpg + 2) * d, *rest)
    q, k, v = g.split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest))


def _pad_vocab(w: torch.Tensor, layout: Qwen3Layout) -> torch.Tensor:
    if w.shape[0] == layout.padded_vocab:
        return w
    pad = w.new_zeros(layout.padded_vocab - w.shape[0], *w.shape[1:])
    return torch.cat([w, pad], dim=0)


def hf_layer_to_megatron(i: int, get, layout: Qwen3Layout) -> dict:
    """One decoder layer. get(hf_name) -> tensor. Returns megatron names (global index i)."""
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    a = h + "self_attn."
    return {
        ln1: get(h + "input_layernorm.weight"),
        p + "self_attention.linear_qkv.weight": fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                          get(a + "v_proj.weight"), layout),
        p + "self_attention.q_layernorm.weight": get(a + "q_norm.weight"),
        p + "self_attention.k_layernorm.weight": get(a + "k_norm.weight"),
        p + "self_attention.linear_proj.weight": get(a + "o_proj.weight"),
        ln2: get(h + "post_attention_layernorm.weight"),
        p + "mlp.linear_fc1.weight": torch.cat([get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")], 0),
        p + "mlp.linear_fc2.weight": get(h + "mlp.down_proj.weight"),
    }


def megatron_layer_to_hf(i: int, get, layout: Qwen3Layout) -> dict:
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    q, k, v = split_qkv(get(p + "self_attention.linear_qkv.weight"), layout)
    gate, up = get(p + "mlp.linear_fc1.weight").chunk(2, dim=0)
    a = h + "self_attn."
    return {
        h + "input_layernorm.weight": get(ln1),
        a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
        a + "q_norm.weight": get(p + "self_attention.q_layernorm.weight"),
        a + "k_norm.weight": get(p + "self_attention.k_layernorm.weight"),
        a + "o_proj.weight": get(p + "self_attention.linear_proj.weight"),
        h + "post_attention_layernorm.weight": get(ln2),
        h + "mlp.gate_proj.weight": gate.contiguous(), h + "mlp.up_proj.weight": up.contiguous(),
        h + "mlp.down_proj.weight": get(p + "mlp.linear_fc2.weight"),
    }


def _getter(sd: dict, what: str):
    def get(name):
        if name not in sd:
            raise KeyError(f"{what} state dict has no tensor {name!r}")
        return sd[name]
    return get


def hf_to_megatron(hf_sd: dict, layout: Qwen3Layout) -> dict:
    get = _getter(hf_sd, "HF")
    out = {"embedding.word_embeddings.weight": _pad_vocab(get("model.embed_tokens.weight"), layout),
           "decoder.final_layernorm.weight": get("model.norm.weight")}
    if not layout.tied:
        out["output_layer.weight"] = _pad_vocab(get("lm_head.weight"), layout)
    for i in range(layout.num_layers):
        out.update(hf_layer_to_megatron(i, get, layout))
    return out


def megatron_to_hf(mg_sd: dict, layout: Qwen3Layout) -> dict:
    get = _getter(mg_sd, "Megatron")
    out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight")[:layout.vocab].contiguous(),
           "model.norm.weight": get("decoder.final_layernorm.weight")}
    if not layout.tied:
        out["lm_head.weight"] = get("output_layer.weight")[:layout.vocab].contiguous()
    for i in range(layout.num_layers):
        out.update(megatron_layer_to_hf(i, get, layout))
    return out


# ---------------------------------------------------------------------------------------------
# Tensor- and pipeline-parallel sharding of megatron names.

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def tp_split_kind(name: str) -> str:
    """How a megatron tensor is split over TP ranks: row/column/fc1/vocab/replicated."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "vocab"
    if name.endswith("linear_qkv.weight"):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    kind = tp_split_kind(name)
    if tp_size == 1 or kind == "replicated":
        return full
    if kind in ("vocab", "column"):
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)


def tp_merge(name: str, shards: list) -> torch.Tensor:
    kind = tp_split_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind in ("vocab", "column"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline parallel size {pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def to_local_name(name: str, pp_rank: int, pp_size: int, num_layers: int):
    """Global megatron name -> this stage's local name, or None when another stage owns it."""
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    m = _LAYER.match(name)
    if m:
        layers = stage_layers(num_layers, pp_rank, pp_size)
        i = int(m.group(1))
        return f"decoder.layers.{i - layers.start}.{m.group(2)}" if i in layers else None
    if name.startswith("embedding."):
        return name if first else None
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return name if last else None
    return name


def to_global_name(local: str, pp_rank: int, pp_size: int, num_layers: int) -> str:
    m = _LAYER.match(local)
    if not m:
        return local
    start = stage_layers(num_layers, pp_rank, pp_size).start
    return f"decoder.layers.{int(m.group(1)) + start}.{m.group(2)}"


def shard_for_rank(full_mg: dict, layout: Qwen3Layout, tp_rank: int, tp_size: int,
                   pp_rank: int, pp_size: int) -> dict:
    """The local state dict one (tp_rank, pp_rank) holds, from a full megatron state dict."""
    out = {}
    for name, tensor in full_mg.items():
        local = to_local_name(name, pp_rank, pp_size, layout.num_layers)
        if local is not None:
            out[local] = tp_shard(name, tensor, tp_rank, tp_size)
    if layout.tied and pp_size > 1 and pp_rank == pp_size - 1:
        # The last stage holds its own copy of the tied embedding as output_layer.weight.
        out["output_layer.weight"] = tp_shard("output_layer.weight", full_mg["embedding.word_embeddings.weight"],
                                              tp_rank, tp_size)
    return out
