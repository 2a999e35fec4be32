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
    """The layout of a supported model; a ValueError naming the config.json field otherwise."""
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"config.json architectures={archs}: only {SUPPORTED_ARCHITECTURES} is supported "
            "(Qwen2.5 adds q/k/v biases and has no qk-norm; Llama 3 has no qk-norm and uses "
            "llama3 RoPE scaling: neither is mapped nor built by megatron_dppo.megatron.model)"
        )
    # Fields a Qwen3 checkpoint may set that this mapping (or the GPTModel built from the same
    # config) does not carry: refuse rather than convert into a different model.
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("config.json attention_bias=true: q/k/v/o biases are not mapped")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if hf_config.num_attention_heads % hf_config.num_key_value_heads:
        raise ValueError(
            f"config.json num_attention_heads={hf_config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={hf_config.num_key_value_heads}"
        )
    return Qwen3Layout(
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        intermediate=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        padded_vocab=padded_vocab or hf_config.vocab_size,
        tied=bool(hf_config.tie_word_embeddings),
        te_names=te_names,
    )


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


def _layer_rules(i: int, layout: Qwen3Layout) -> dict:
    """megatron name -> (the HF names it is built from, how to build it), for layer i. One table
    serves the whole-layer conversion and the tensor-at-a-time streaming converter."""
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    a = h + "self_attn."
    same = lambda t: t  # noqa: E731
    return {
        ln1: ((h + "input_layernorm.weight",), same),
        p + "self_attention.linear_qkv.weight": (
            (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            lambda q, k, v: fuse_qkv(q, k, v, layout),
        ),
        p + "self_attention.q_layernorm.weight": ((a + "q_norm.weight",), same),
        p + "self_attention.k_layernorm.weight": ((a + "k_norm.weight",), same),
        p + "self_attention.linear_proj.weight": ((a + "o_proj.weight",), same),
        ln2: ((h + "post_attention_layernorm.weight",), same),
        p + "mlp.linear_fc1.weight": (
            (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            lambda gate, up: torch.cat([gate, up], 0),
        ),
        p + "mlp.linear_fc2.weight": ((h + "mlp.down_proj.weight",), same),
    }


def _global_rules(layout: Qwen3Layout) -> dict:
    pad = lambda w: _pad_vocab(w, layout)  # noqa: E731
    rules = {
        "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), pad),
        "decoder.final_layernorm.weight": (("model.norm.weight",), lambda t: t),
    }
    if not layout.tied:
        rules["output_layer.weight"] = (("lm_head.weight",), pad)
    return rules


def hf_layer_to_megatron(i: int, get, layout: Qwen3Layout) -> dict:
    """One decoder layer. get(hf_name) -> tensor. Returns megatron names (global index i)."""
    return {name: build(*map(get, srcs)) for name, (srcs, build) in _layer_rules(i, layout).items()}


def megatron_tensor_from_hf(name: str, get, layout: Qwen3Layout) -> torch.Tensor:
    """One megatron tensor (global name, TP=1 layout, vocab padded) from the HF tensors it needs:
    the streaming converter reads only those."""
    m = _LAYER.match(name)
    rules = _layer_rules(int(m.group(1)), layout) if m else _global_rules(layout)
    if name not in rules:
        raise KeyError(f"no HF source for megatron tensor {name!r}")
    srcs, build = rules[name]
    return build(*map(get, srcs))


def hf_tensor_names(layout: Qwen3Layout) -> list:
    """Every HF tensor the mapping reads (to check a checkpoint before converting it)."""
    names = [n for srcs, _ in _global_rules(layout).values() for n in srcs]
    for i in range(layout.num_layers):
        names += [n for srcs, _ in _layer_rules(i, layout).values() for n in srcs]
    return names


def megatron_layer_to_hf(i: int, get, layout: Qwen3Layout) -> dict:
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    q, k, v = split_qkv(get(p + "self_attention.linear_qkv.weight"), layout)
    gate, up = get(p + "mlp.linear_fc1.weight").chunk(2, dim=0)
    a = h + "self_attn."
    return {
        h + "input_layernorm.weight": get(ln1),
        a + "q_proj.weight": q,
        a + "k_proj.weight": k,
        a + "v_proj.weight": v,
        a + "q_norm.weight": get(p + "self_attention.q_layernorm.weight"),
        a + "k_norm.weight": get(p + "self_attention.k_layernorm.weight"),
        a + "o_proj.weight": get(p + "self_attention.linear_proj.weight"),
        h + "post_attention_layernorm.weight": get(ln2),
        h + "mlp.gate_proj.weight": gate.contiguous(),
        h + "mlp.up_proj.weight": up.contiguous(),
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
    out = {name: build(*map(get, srcs)) for name, (srcs, build) in _global_rules(layout).items()}
    for i in range(layout.num_layers):
        out.update(hf_layer_to_megatron(i, get, layout))
    return out


def _global_to_hf(layout: Qwen3Layout) -> dict:
    """HF name -> (megatron name, how): the tensors outside the decoder layers (vocab padding cut)."""
    trim = lambda w: w[: layout.vocab].contiguous()  # noqa: E731
    rules = {
        "model.embed_tokens.weight": ("embedding.word_embeddings.weight", trim),
        "model.norm.weight": ("decoder.final_layernorm.weight", lambda t: t),
    }
    if not layout.tied:
        rules["lm_head.weight"] = ("output_layer.weight", trim)
    return rules


def global_hf_sources(layout: Qwen3Layout) -> dict:
    """HF name -> the megatron name it comes from, for the tensors outside the decoder layers."""
    return {hf: mg for hf, (mg, _) in _global_to_hf(layout).items()}


def megatron_globals_to_hf(get, layout: Qwen3Layout, hf_names=None) -> dict:
    """The non-layer HF tensors (or only hf_names of them) from megatron tensors via get."""
    rules = _global_to_hf(layout)
    return {hf: fn(get(mg)) for hf, (mg, fn) in rules.items() if hf_names is None or hf in hf_names}


def megatron_to_hf(mg_sd: dict, layout: Qwen3Layout) -> dict:
    get = _getter(mg_sd, "Megatron")
    out = megatron_globals_to_hf(get, layout)
    for i in range(layout.num_layers):
        out.update(megatron_layer_to_hf(i, get, layout))
    return out


# ---------------------------------------------------------------------------------------------
# Tensor- and pipeline-parallel sharding of megatron names.

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def layer_index(name: str):
    """The layer number of a global megatron name (decoder.layers.L.*), or None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


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


def shard_for_rank(full_mg: dict, layout: Qwen3Layout, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> dict:
    """The local state dict one (tp_rank, pp_rank) holds, from a full megatron state dict."""
    out = {}
    for name, tensor in full_mg.items():
        local = to_local_name(name, pp_rank, pp_size, layout.num_layers)
        if local is not None:
            out[local] = tp_shard(name, tensor, tp_rank, tp_size)
    if layout.tied and pp_size > 1 and pp_rank == pp_size - 1:
        # The last stage holds its own copy of the tied embedding as output_layer.weight.
        out["output_layer.weight"] = tp_shard(
            "output_layer.weight", full_mg["embedding.word_embeddings.weight"], tp_rank, tp_size
        )
    return out
