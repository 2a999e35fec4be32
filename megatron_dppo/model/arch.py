"""The numbers of a model architecture, from its HF config.json alone: shapes and parameter
counts per layer and per rank (what `plan` and the throughput profile compute with)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """The numbers of a model of a supported family (model/families.py: GQA attention, SwiGLU MLP,
    RMSNorm; Qwen3's qk-norm, Qwen2's q/k/v biases), dense or a mixture of experts (Qwen3 MoE:
    sparse layers of routed SwiGLU experts, no shared expert)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    experts: int = 0  # routed experts per sparse layer; 0: a dense model
    experts_per_tok: int = 0  # top-k
    moe_ffn: int = 0  # each expert's SwiGLU width (moe_intermediate_size)
    sparse: tuple = ()  # per layer: True where the MLP is an MoE layer (empty: dense)
    qk_norm: bool = True  # Qwen3's q/k RMSNorm (head_dim each, replicated over TP)
    qkv_bias: bool = False  # Qwen2's q/k/v biases (split over TP with the QKV rows)

    @classmethod
    def from_hf(cls, c: dict) -> Arch:
        """The numbers of config.json `c` (a dict), after the trainer's own check of it
        (from_hf_config): a model `train` refuses is a ValueError here too, naming the field."""
        from transformers import CONFIG_MAPPING

        from megatron_dppo.model.families import check_config_keys

        model_type = c.get("model_type", "qwen3")
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"config.json model_type={model_type!r}: not a model type transformers knows")
        config = CONFIG_MAPPING[model_type].from_dict({k: v for k, v in c.items() if k != "transformers_version"})
        # The sizes the trainer requires (not architectures: the arithmetic does not need vLLM's class).
        check_config_keys(c, config, architectures_needed=False)
        return cls.from_hf_config(config)

    @classmethod
    def from_hf_config(cls, hf) -> Arch:
        """The numbers of a transformers config, after model/qwen3.layout_from_hf_config's check
        (the one the trainer and the converters make): ValueError naming the field."""
        from megatron_dppo.model import qwen3

        lay = qwen3.layout_from_hf_config(hf)
        return cls(
            vocab=lay.vocab,
            hidden=lay.hidden,
            layers=lay.num_layers,
            heads=lay.num_heads,
            kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            ffn=lay.intermediate,
            tied=lay.tied,
            experts=lay.num_experts if lay.moe_layers else 0,
            experts_per_tok=int(getattr(hf, "num_experts_per_tok", 0)) if lay.moe_layers else 0,
            moe_ffn=lay.moe_intermediate,
            sparse=lay.moe_layers,
            qk_norm=lay.qk_norm,
            qkv_bias=lay.qkv_bias,
        )

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse) and self.sparse[layer]

    def layer_params(self, tp: int = 1, sparse: bool = False) -> int:
        """One decoder layer on one TP rank, experts not included: QKV, out-proj (and a dense
        layer's fc1 [gate; up], fc2) are split over TP; the two RMSNorms (hidden), q/k-norms
        (head_dim) and an MoE layer's router (experts x hidden) are replicated."""
        h = self.hidden
        replicated = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        if sparse:
            return self.attention_params() // tp + replicated + self.experts * h
        return (self.attention_params() + self.dense_mlp_params()) // tp + replicated

    def attention_params(self) -> int:
        """One layer's attention weights, whole: QKV (heads + 2 KV heads; with their biases) and
        the out-proj."""
        h, d = self.hidden, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * d
        return qkv * (h + self.qkv_bias) + self.heads * d * h

    def dense_mlp_params(self) -> int:
        """One dense layer's SwiGLU weights, whole: fc1 [gate; up] and fc2."""
        return 3 * self.hidden * self.ffn

    def expert_params(self, ep: int = 1, etp: int = 1) -> int:
        """One sparse layer's experts on one rank: num_experts / ep SwiGLU experts split over etp."""
        return self.experts // ep * 3 * self.hidden * self.moe_ffn // etp

    def hf_params(self) -> int:
        """Parameter count of the HF checkpoint (unpadded vocabulary)."""
        body = sum(
            self.layer_params(1, self.is_sparse(i)) + (self.expert_params() if self.is_sparse(i) else 0)
            for i in range(self.layers)
        )
        return self.vocab * self.hidden * (1 if self.tied else 2) + body + self.hidden

    def active_params(self) -> int:
        """Parameters a token passes through (top-k of the experts): the 'A3B' of Qwen3-30B-A3B."""
        inactive = sum(self.is_sparse(i) for i in range(self.layers)) * (self.experts - self.experts_per_tok)
        return self.hf_params() - inactive * 3 * self.hidden * self.moe_ffn

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes one token takes on one rank of a vLLM engine of TP `tp`: K and V of every
        layer for the rank's KV heads. vLLM splits the KV heads over its TP ranks and, where tp
        exceeds them, gives each rank one replicated head (its get_num_kv_heads); the cache size
        it is given (kv_cache_memory_bytes, gpu_memory_utilization) is per rank."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes
