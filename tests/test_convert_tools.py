"""The checkpoint converters end to end (tools/convert_hf_to_megatron.py, tools/convert_megatron_to_hf.py).

Tiny random fp32 Qwen3 models saved as several safetensors shards + index: vocab 50 (padded by
Megatron to 128 * tp), head_dim 32 != hidden / heads = 16, GQA (4 query heads, 2 KV groups),
tied and untied embeddings, norms perturbed away from 1.
  * HF -> Megatron, then the trainer's load_checkpoint in torchrun workers: logits equal
    transformers' within 1e-5 at TP=2, TP=1 (another vocab padding than converted for) and PP=2;
  * HF -> Megatron -> HF is bitwise identical (tensors, dtypes, config.json, generation config);
  * the converted chunks equal what a real TP=2 trainer save writes, key for key;
  * a trainer checkpoint (step dir with model + optimizer, found through `latest`) -> HF equals
    the trained weights bit for bit;
  * bad inputs are errors naming the file or config field.
"""
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TO_MG = REPO / "tools" / "convert_hf_to_megatron.py"
TO_HF = REPO / "tools" / "convert_megatron_to_hf.py"
TRAINER_WORKER = REPO / "tests" / "dist_convert" / "trainer_ckpt.py"


def _make_hf(path: Path, tied: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=50, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, tie_word_embeddings=tied,
                      max_position_embeddings=128, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(1 + tied)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():  # HF inits norms to 1: perturb them so a swapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB")  # several shards + index
    assert len(list(path.glob("*.safetensors"))) > 3
    return path


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"tied": _make_hf(root / "tied", True), "untied": _make_hf(root / "untied", False)}


def _weights(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _ok(res) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-8000:]
    return out


def _assert_bitwise_roundtrip(hf: Path, back: Path):
    a, b = _weights(hf), _weights(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((hf / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    assert (hf / "generation_config.json").read_bytes() == (back / "generation_config.json").read_bytes()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(a) and all((back / f).exists() for f in index["weight_map"].values())

    from transformers import AutoModelForCausalLM  # it loads, and computes the same thing
    x = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf)(x).logits
        got = AutoModelForCausalLM.from_pretrained(back)(x).logits
    assert torch.equal(ref, got)


def _logit_diff(output: str) -> float:
    line = next(ln for ln in output.splitlines() if ln.startswith("verify OK"))
    return float(line.split("difference|")[1].split()[0])


def _chunks(md) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[key] = (tuple(m.size), m.properties.dtype,
                        sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
        else:
            out[key] = "bytes"
    return out


def test_untied_tp2_tp1_trainer_checkpoint_and_roundtrip(hf_models, tmp_path, launch):
    hf, mg = hf_models["untied"], tmp_path / "mg"
    # Converted for TP=2 (vocab padded to 256), verified by torchrun workers at TP=2 ...
    out = _ok(launch(TO_MG, 1, "--hf-dir", hf, "--out-dir", mg, "--tp", 2, "--verify", "--tolerance", 1e-5))
    assert "vocab 50 padded to 256" in out and _logit_diff(out) <= 1e-5
    state = json.loads((mg / "trainer_state.json").read_text())
    assert state["model_only"] and state["step"] == 0 and state["source"]["padded_vocab"] == 256
    # ... and loaded at TP=1, whose padding is 128 rows (Megatron cuts the extra rows).
    out = _ok(launch(TO_MG, 1, "--hf-dir", hf, "--out-dir", mg, "--tp", 1, "--verify-only", "--tolerance", 1e-5))
    assert _logit_diff(out) <= 1e-5

    back = tmp_path / "back"
    out = _ok(launch(TO_HF, 1, "--megatron-dir", mg, "--out-dir", back, "--max-shard-size", "150KB"))
    assert "peak RSS" in out and len(list(back.glob("*.safetensors"))) > 1
    _assert_bitwise_roundtrip(hf, back)

    # The trainer (TP=2) loads it, takes a step and saves model + optimizer; convert that back.
    root, ref = tmp_path / "run", tmp_path / "trained.safetensors"
    _ok(launch(TRAINER_WORKER, 2, "--ckpt", mg, "--hf-dir", hf, "--root", root, "--ref", ref, "--tp", 2))
    from megatron_dppo.megatron.checkpoint import _restricted_metadata_pickle  # noqa: F401  (safe unpickler)
    from torch.distributed.checkpoint import FileSystemReader

    ours = _chunks(FileSystemReader(str(mg / "model_optim")).read_metadata())
    theirs = _chunks(FileSystemReader(str(root / "step_000001" / "model_optim")).read_metadata())
    model_keys = {k for k in theirs if not k.startswith("optimizer.")}
    assert model_keys == set(ours), (sorted(model_keys ^ set(ours)))[:6]
    for k in ours:  # same global shapes, dtypes and chunks as a TP=2 save of the model
        assert ours[k] == theirs[k], k
    assert len(theirs) > len(ours)  # the trainer's also holds optimizer state

    trained_hf = tmp_path / "trained_hf"
    _ok(launch(TO_HF, 1, "--megatron-dir", root, "--out-dir", trained_hf))  # root: found via `latest`
    expect, got, orig = load_file(ref), _weights(trained_hf), _weights(hf)
    assert expect.keys() == got.keys() == orig.keys()
    for k in expect:
        assert torch.equal(expect[k], got[k]), k
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], orig["model.layers.0.mlp.up_proj.weight"])
    assert json.loads((trained_hf / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


def test_tied_pp2_and_roundtrip(hf_models, tmp_path, launch):
    hf, mg, back = hf_models["tied"], tmp_path / "mg", tmp_path / "back"
    # PP=2: the last stage holds its own copy of the tied embedding as the output layer.
    out = _ok(launch(TO_MG, 1, "--hf-dir", hf, "--out-dir", mg, "--pp", 2, "--verify", "--tolerance", 1e-5))
    assert "vocab 50 padded to 128" in out and _logit_diff(out) <= 1e-5
    _ok(launch(TO_HF, 1, "--megatron-dir", mg, "--out-dir", back))
    assert "lm_head.weight" not in _weights(back)
    _assert_bitwise_roundtrip(hf, back)
    # Negative control: checked against other weights, --verify fails with exit status 1.
    res = launch(TO_MG, 1, "--hf-dir", hf_models["untied"], "--out-dir", mg, "--verify-only")
    assert res.returncode == 1 and "verify FAILED" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def _tool(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error(capsys, tool, *argv) -> str:
    assert tool.main([str(a) for a in argv]) == 2
    return capsys.readouterr().err


def test_bad_inputs_are_named(hf_models, tmp_path, capsys):
    to_mg, to_hf = _tool(TO_MG), _tool(TO_HF)
    out = tmp_path / "out"
    for arch, model_type in [("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2")]:
        bad = tmp_path / model_type
        shutil.copytree(hf_models["tied"], bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch], model_type=model_type)))
        err = _error(capsys, to_mg, "--hf-dir", bad, "--out-dir", out)
        assert f"config.json architectures=['{arch}']" in err, err

    missing = tmp_path / "missing"
    shutil.copytree(hf_models["untied"], missing)
    (missing / "model-00003-of-00009.safetensors").unlink()
    err = _error(capsys, to_mg, "--hf-dir", missing, "--out-dir", out)
    assert "model.safetensors.index.json names shard 'model-00003-of-00009.safetensors'" in err, err

    err = _error(capsys, to_mg, "--hf-dir", hf_models["untied"], "--out-dir", out, "--tp", 3, "--pp", 3)
    for text in ["config.json", "num_attention_heads 4 is not divisible by tp=3",
                 "num_key_value_heads (query groups) 2 is not divisible by tp=3", "num_layers 4 is not divisible by pp=3"]:
        assert text in err, err

    err = _error(capsys, to_mg, "--hf-dir", tmp_path, "--out-dir", out)
    assert f"{tmp_path / 'config.json'} is missing" in err, err

    (tmp_path / "nocfg" / "model_optim").mkdir(parents=True)
    err = _error(capsys, to_hf, "--megatron-dir", tmp_path / "nocfg", "--out-dir", out)
    assert "hf_config.json is missing" in err, err
    err = _error(capsys, to_hf, "--megatron-dir", tmp_path, "--out-dir", out)
    assert "has no model_optim/" in err, err
    assert not out.exists()  # nothing written on any error
