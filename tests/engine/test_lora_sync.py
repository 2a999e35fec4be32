"""RolloutEngine(lora_rank>0) serves PEFT LoRA adapters on the tiny example's Qwen3, loaded in place,
and a sync that did not arrive is caught.

`peft` is the independent reference: two adapters (all seven HF linears, r=8, alpha=16, random A and B)
are written from PEFT models' own state with model/peft_dir.py's write_peft_adapter; vLLM's log-probs
of its sampled sequences must equal the PEFT model's (transformers forward) within the weight-sync
test's 1e-4, and differ from the base model's. One engine for the module (its start costs ~30 s on
this loaded machine); each test loads what it needs under a fresh version.
"""

import itertools
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from megatron_dppo.model.peft_dir import PEFT_PREFIX, ROLE_MODULES, read_peft_adapter, write_peft_adapter
from megatron_dppo.rollout import RolloutEngine, hf_completion_logprobs

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "tiny" / "model"  # vocabulary 21, 3 layers, tied embeddings
TARGETS = [m for modules in ROLE_MODULES.values() for m in modules]
RANK, ALPHA = 8, 16
PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
# Longer than one 32-token KV block: its first block lands in vLLM's prefix cache.
LONG = [3 + i % 17 for i in range(40)]
TOLERANCE = 1e-4  # tests/engine/test_weight_sync.py's
_versions = itertools.count(1)


def _base():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def _peft_model(seed: int):
    """The base model with a PEFT LoRA adapter whose A and B are all random (seeded): PEFT's own
    init leaves B at zero, an adapter that would change nothing."""
    model = get_peft_model(_base(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _adapter_tensors(peft_model) -> dict:
    """The PEFT model's adapter under HF names (write_peft_adapter adds PEFT's prefix back)."""
    return {k.removeprefix(PEFT_PREFIX): v for k, v in get_peft_model_state_dict(peft_model).items()}


def _write(directory, tensors, version):
    kw = dict(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=TARGETS, base_model=str(MODEL))
    return write_peft_adapter(directory, tensors, version=version, **kw)


@pytest.fixture(scope="module")
def models():
    return {"base": _base(), "one": _peft_model(seed=1), "two": _peft_model(seed=2)}


@pytest.fixture(scope="module")
def engine():
    eng = RolloutEngine(
        str(MODEL),
        dtype="float32",
        max_model_len=64,
        seed=0,
        kv_cache_memory_bytes=16 << 20,
        block_size=32,  # vLLM's CPU default (128) exceeds max_model_len: nothing would be prefix-cached
        lora_rank=RANK,
    )
    try:
        eng.generate(PROMPTS, n=1, max_new_tokens=4)
        eng.first_generate_error = None
    except RuntimeError as e:  # the engine has served nothing yet: generate must refuse
        eng.first_generate_error = str(e)
    yield eng
    eng.close()


def _load(engine, tmp_path, tensors, name="adapter") -> dict:
    version = next(_versions)
    return engine.load_adapter(_write(tmp_path / name, tensors, version), version)


def _max_err(model, prompts, completions) -> float:
    ref = hf_completion_logprobs(model, prompts, [c.token_ids for c in completions])
    return max((r - torch.tensor(c.logprobs)).abs().max().item() for r, c in zip(ref, completions))


def _sample(engine, prompts, seed=0):
    out = engine.generate(prompts, n=4, max_new_tokens=12, temperature=1.0, seed=seed)
    return [p for p, r in zip(prompts, out) for _ in r], [c for r in out for c in r]


def test_generate_before_any_adapter_is_refused(engine):
    assert engine.first_generate_error is not None
    assert "none is loaded: call load_adapter(directory, version) first" in engine.first_generate_error
    assert "\n" not in engine.first_generate_error


def test_vllm_serves_the_peft_adapter(engine, models, tmp_path):
    stats = _load(engine, tmp_path, _adapter_tensors(models["one"]))
    assert stats["num_tensors"] == 2 * len(TARGETS) * 3  # A and B of 7 modules in 3 layers
    assert stats["num_bytes"] > 0 and stats["seconds"] > stats["check_seconds"] > 0
    prompts, completions = _sample(engine, PROMPTS + [LONG])
    assert _max_err(models["one"], prompts, completions) < TOLERANCE
    assert _max_err(models["base"], prompts, completions) > 1e-2  # the adapter visibly acts


def test_second_adapter_replaces_the_first_in_place(engine, models, tmp_path):
    _load(engine, tmp_path, _adapter_tensors(models["one"]))
    prompts, completions = _sample(engine, [LONG])  # caches LONG's first block under adapter one
    assert _max_err(models["one"], prompts, completions) < TOLERANCE
    _load(engine, tmp_path, _adapter_tensors(models["two"]))  # same directory, next version
    prompts, completions = _sample(engine, PROMPTS + [LONG], seed=1)
    assert _max_err(models["two"], prompts, completions) < TOLERANCE
    assert _max_err(models["one"], prompts, completions) > 1e-2
    assert engine.llm.llm_engine.list_loras() == {1}  # one adapter slot, reused


def test_directory_holding_another_version_is_refused(engine, models, tmp_path):
    directory = _write(tmp_path / "stale", _adapter_tensors(models["one"]), version=1000)
    with pytest.raises(RuntimeError, match=r"holds adapter version 1000, not 1001: the sync did not arrive"):
        engine.load_adapter(directory, 1001)


def test_version_that_did_not_change_is_refused(engine, models, tmp_path):
    _load(engine, tmp_path, _adapter_tensors(models["one"]))
    with pytest.raises(RuntimeError, match=r"adapter version \d+ did not change"):
        engine.load_adapter(tmp_path / "adapter", engine._adapter_version)


def test_adapter_vllm_did_not_replace_is_caught(engine, models, tmp_path, monkeypatch):
    """The peers' silent no-op (verl #7495): vLLM keeps serving the previous adapter. Here its worker
    ignores the in-place load, as it would for a request without load_inplace."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    _load(engine, tmp_path, _adapter_tensors(models["one"]))
    monkeypatch.setattr(LRUCacheWorkerLoRAManager, "add_adapter", lambda self, request: False)
    with pytest.raises(
        RuntimeError, match=r"did not arrive in vLLM: module model\.layers\.0\.\S+: lora_[AB] holds other"
    ):
        _load(engine, tmp_path, _adapter_tensors(models["two"]))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="none is loaded"):  # a failed sync serves nothing
        engine.generate(PROMPTS, n=1, max_new_tokens=4)


def test_check_fed_the_previous_adapter_names_a_module(engine, models, tmp_path):
    _load(engine, tmp_path, _adapter_tensors(models["two"]))
    _, config = read_peft_adapter(tmp_path / "adapter")
    with pytest.raises(
        RuntimeError,
        match=r"version 7 did not arrive in vLLM: module model\.layers\.0\.self_attn\.q_proj: lora_A holds other",
    ):
        engine.check_served_adapter(_adapter_tensors(models["one"]), config, version=7)
    tensors = _adapter_tensors(models["two"])
    tensors["model.layers.1.mlp.up_proj.lora_B.weight"] = tensors["model.layers.1.mlp.up_proj.lora_B.weight"] * 1.001
    with pytest.raises(RuntimeError, match=r"module model\.layers\.1\.mlp\.up_proj: lora_B holds other weights"):
        engine.check_served_adapter(tensors, config, version=7)


def test_module_vllm_has_no_layer_for_is_caught(engine, models, tmp_path):
    """A misnamed module (here a layer index the model lacks): vLLM loads the adapter without a word
    and serves its other modules, this one applies nowhere."""
    tensors = {k.replace("layers.2.", "layers.7."): v for k, v in _adapter_tensors(models["one"]).items()}
    directory = _write(tmp_path / "misnamed", tensors, version=9999)
    from vllm.lora.request import LoRARequest

    assert engine.llm.llm_engine.add_lora(LoRARequest("probe", 2, str(directory))) is not False  # vLLM: no error
    engine.llm.llm_engine.remove_lora(2)
    with pytest.raises(RuntimeError, match=r"module model\.layers\.7\.mlp\.down_proj: vLLM has no LoRA layer"):
        engine.load_adapter(directory, 9999)


def test_module_name_vllm_does_not_know_is_refused_in_one_line(engine, models, tmp_path):
    tensors = {k.replace(".q_proj.", ".query."): v for k, v in _adapter_tensors(models["one"]).items()}
    directory = write_peft_adapter(
        tmp_path / "unknown",
        tensors,
        rank=RANK,
        alpha=ALPHA,
        dropout=0.0,
        target_modules=TARGETS + ["query"],
        base_model=str(MODEL),
        version=424242,
    )
    with pytest.raises(RuntimeError) as e:
        engine.load_adapter(directory, 424242)
    assert "vLLM refused adapter version 424242" in str(e.value) and "query" in str(e.value)
    assert "\n" not in str(e.value)


def test_load_weights_drops_the_adapter_until_the_next_load(engine, models, tmp_path):
    """vLLM's weight reload removes its adapters; its next request would load the directory again on
    its own, unchecked: the engine refuses to generate until load_adapter."""
    _load(engine, tmp_path, _adapter_tensors(models["one"]))
    engine.load_weights(models["base"].state_dict().items())
    with pytest.raises(RuntimeError, match="none is loaded: call load_adapter.*also after load_weights"):
        engine.generate(PROMPTS, n=1, max_new_tokens=4)
    _load(engine, tmp_path, _adapter_tensors(models["one"]))
    prompts, completions = _sample(engine, PROMPTS)
    assert _max_err(models["one"], prompts, completions) < TOLERANCE
