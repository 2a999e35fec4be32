"""Qwen3 mixture-of-experts in torchrun workers: the model (megatron/moe.py) against transformers at
EP=1 and EP=2 (tests/dist/workers/model/moe_worker.py), and conversion at EP=2 and TP=2 with sharded
loading of only a rank's experts (tests/dist/workers/convert/moe_ckpt.py). The in-memory mapping:
tests/unit/test_moe.py."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_qwen3_moe_model
from worker_results import ok_output as _ok
from worker_results import safetensors_weights as _weights

REPO = Path(__file__).resolve().parents[2]
DIST = REPO / "tests" / "dist" / "workers" / "model"
TO_MG = REPO / "tools" / "convert_hf_to_megatron.py"
TO_HF = REPO / "tools" / "convert_megatron_to_hf.py"
CKPT_WORKER = REPO / "tests" / "dist" / "workers" / "convert" / "moe_ckpt.py"


def test_moe_model_matches_transformers_at_ep1_and_ep2(torchrun):
    """Packed THD log-probs and gradients equal transformers' Qwen3MoeForCausalLM (fp32, 1e-5)
    at EP=1 and EP=2 (alltoall over gloo), for two routing variants (moe_worker.py says how)."""
    out = torchrun(DIST / "moe_worker.py", 2)
    assert out.count("max |logp diff|") == 8 and "OK" in out


# ---- conversion tools and sharded loading at EP=2 and TP=2 --------------------------------------
# Session scope, not module: cheap to build again on each pytest-xdist worker, and a module fixture
# would tie all of this file's tests to one worker (tests/conftest.py).
@pytest.fixture(scope="session")
def moe_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "hf"
    _, model = tiny_qwen3_moe_model(5)
    model.save_pretrained(path, max_shard_size="200KB")  # several shards + index, per-expert names
    assert len(list(path.glob("*.safetensors"))) > 3
    return path


def _assert_same_weights(a: Path, b: Path):
    x, y = _weights(a), _weights(b)
    assert x.keys() == y.keys() and any(".mlp.experts.7.down_proj" in k for k in x)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--ep", "--tp"])
def test_conversion_round_trip_is_bitwise_at_ep2_and_tp2(moe_hf, tmp_path, launch, flag):
    """HF -> Megatron (tools, at --ep 2 or --tp 2) -> the trainer's load_checkpoint in 2 torchrun
    workers at that layout (each rank's tensors bitwise equal to the HF files; the HF loader reads
    only the rank's experts; logits equal transformers' within 1e-5) -> the trainer's
    save_checkpoint at that layout -> HF: bitwise equal to the original. At --ep 2 the tool's own
    --verify launches the 2 processes."""
    mg, root, back = tmp_path / "mg", tmp_path / "run", tmp_path / "back"
    verify = ["--verify", "--tolerance", 1e-5] if flag == "--ep" else []
    out = _ok(launch(TO_MG, 1, "--hf-dir", moe_hf, "--out-dir", mg, flag, 2, *verify))
    assert json.loads((mg / "trainer_state.json").read_text())["source"][flag[2:]] == 2
    if verify:
        assert "(tp=1, pp=1, ep=2, cpu)" in out and "verify OK" in out
        diff = float(out.split("verify OK: max |logit difference| ")[1].split()[0])
        assert diff <= 1e-5
    out = _ok(launch(CKPT_WORKER, 2, "--ckpt", mg, "--hf-dir", moe_hf, "--root", root, flag, 2))
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2
    for r in results:
        assert r["converted_vs_hf"] == [] and r["hf_load_vs_hf"] == [] and r["dense_unread"] == []
        assert r["experts_read"] == r["experts_owned"] and r["logit_diff"] <= 1e-5
        assert len(r["experts_owned"]) == (4 if flag == "--ep" else 8)
    _ok(launch(TO_HF, 1, "--megatron-dir", root, "--out-dir", back))  # root: found via `latest`
    _assert_same_weights(moe_hf, back)
