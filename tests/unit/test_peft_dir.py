"""model/peft_dir.py: the PEFT adapter directory the LoRA weight sync writes, checked against `peft`
itself (it loads the directory and computes the same log-probs as the model the tensors came from),
and its one-line refusals."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from megatron_dppo.model import peft_dir
from megatron_dppo.model.peft_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    ROLE_MODULES,
    PeftDirError,
    hf_modules,
    read_adapter_weights,
    read_peft_adapter,
    write_peft_adapter,
)

MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"
TARGETS = [m for modules in ROLE_MODULES.values() for m in modules]
KW = dict(rank=8, alpha=16, dropout=0.0, target_modules=TARGETS, base_model=str(MODEL))


def _base():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def peft_model():
    model = get_peft_model(_base(), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # PEFT's init leaves B at zero: an adapter that changes nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _tensors(peft_model) -> dict:
    return {k.removeprefix(PEFT_PREFIX): v for k, v in get_peft_model_state_dict(peft_model).items()}


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_peft_loads_the_directory_and_computes_the_same_logprobs(peft_model, tmp_path):
    directory = write_peft_adapter(tmp_path / "adapter", _tensors(peft_model), **KW)
    assert sorted(p.name for p in directory.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]  # no temporary left
    loaded = PeftModel.from_pretrained(_base(), directory).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(peft_model, ids), rtol=0, atol=1e-6)
    assert (_logprobs(loaded, ids) - _logprobs(_base(), ids)).abs().max() > 1e-2  # the adapter acts


def test_round_trip_and_version_stamp(peft_model, tmp_path):
    sent = _tensors(peft_model)
    write_peft_adapter(tmp_path, sent, **KW, version=12)
    tensors, config = read_peft_adapter(tmp_path)
    assert tensors.keys() == sent.keys() and all(torch.equal(tensors[k], sent[k]) for k in sent)
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 16, "none")
    assert sorted(config["target_modules"]) == sorted(TARGETS) and config["base_model_name_or_path"] == str(MODEL)
    assert read_adapter_weights(tmp_path)[1] == 12
    write_peft_adapter(tmp_path, sent, **KW)  # rewritten in place, unstamped
    assert read_adapter_weights(tmp_path)[1] is None


def test_roles_map_to_hf_modules():
    assert hf_modules(["fc2", "qkv"]) == ["q_proj", "k_proj", "v_proj", "down_proj"]
    with pytest.raises(PeftDirError, match="LoRA role 'mlp'"):
        hf_modules(["mlp"])


def test_a_failed_write_leaves_the_previous_adapter(peft_model, tmp_path, monkeypatch):
    sent = _tensors(peft_model)
    write_peft_adapter(tmp_path, sent, **KW, version=1)

    def half_written(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 10)
        raise OSError("disk full")

    monkeypatch.setattr(peft_dir, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        write_peft_adapter(tmp_path, sent, **KW, version=2)
    assert read_adapter_weights(tmp_path)[1] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.0.mlp.up_proj.lora_B.weight"),
            "module 'model.layers.0.mlp.up_proj': has no lora_B",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 128)}),
            r"expected lora_A \[8, in\] and lora_B \[out, 8\] \(rank 8\), got \[4, 128\]",
        ),
        (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 8)}), "ending in .lora_A.weight or"),
        (lambda t: t.update({"model.layers.0.mlp.fc.lora_A.weight": torch.zeros(8, 8)}), "not in target_modules"),
        (lambda t: t.update({PEFT_PREFIX + "model.x.q_proj.lora_A.weight": torch.zeros(8, 8)}), "without 'base_model"),
    ],
)
def test_bad_tensors_are_refused_in_one_line(peft_model, tmp_path, edit, message):
    tensors = _tensors(peft_model)
    edit(tensors)
    with pytest.raises(PeftDirError, match=message) as e:
        write_peft_adapter(tmp_path / "out", tensors, **KW)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_missing_or_garbled_files_are_named(peft_model, tmp_path):
    with pytest.raises(PeftDirError, match=f"{tmp_path}/{ADAPTER_CONFIG} is missing"):
        read_peft_adapter(tmp_path)
    write_peft_adapter(tmp_path, _tensors(peft_model), **KW)
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(PeftDirError, match=f"{tmp_path}/{ADAPTER_WEIGHTS} is not a readable safetensors file"):
        read_peft_adapter(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text("{")
    with pytest.raises(PeftDirError, match=f"{tmp_path}/{ADAPTER_CONFIG} is not valid JSON"):
        read_peft_adapter(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(PeftDirError, match="has no 'lora_alpha' key"):
        read_peft_adapter(tmp_path)
