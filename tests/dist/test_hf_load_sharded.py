"""Sharded HF loading (megatron_dppo/megatron/hf_load.py) under torchrun (2 processes) at TP=1 (DP=2),
TP=2 and PP=2: tests/dist/workers/load/load_check.py checks that the sharded loader gives bit for bit
what the whole-checkpoint path gives (and what Megatron's partition attributes cut), that logits equal
transformers' within 1e-5, the model.init_checkpoint sequence (load_checkpoint +
copy_policy_to_reference), and that each rank read no more than its share of the bytes. The models:
conftest's sharded_hf_models; the model-directory errors: tests/unit/test_hf_load.py."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "dist" / "workers" / "load" / "load_check.py"


def _results(output: str) -> list:
    return [json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1_dp2", "tp2", "pp2"])
def test_sharded_load_equals_whole_checkpoint_and_hf_logits(
    sharded_hf_models, family_hf_models, tmp_path, torchrun, tp, pp
):
    """Qwen3 tied and untied, and the Llama (llama3 RoPE) and Qwen2 (q/k/v biases) families."""
    # ~40 s of CPU; the generous limit is for a shared 2-core machine (load averages of 20+ seen)
    models = [sharded_hf_models["untied"], sharded_hf_models["tied"], *family_hf_models.values()]
    out = torchrun(
        WORKER,
        2,
        "--tp",
        tp,
        "--pp",
        pp,
        "--models",
        ",".join(map(str, models)),
        "--ckpt-root",
        tmp_path / "ckpt",
        timeout=900,
    )
    results = _results(out)
    assert len(results) == 2, out[-4000:]
    for res in results:
        assert len(res["models"]) == 4
        init = res["init_checkpoint"]
        assert init["copied"] and init["reference_mismatches_before_copy"] > 0
        assert not (init["reference_vs_saved"] or init["policy_vs_saved"] or init["reference_after_policy_change"])
        for name, r in res["models"].items():
            assert r["tensors"] > 0
            for key in ("policy_vs_whole", "reference_vs_whole", "policy_vs_partition_attrs"):
                assert r[key] == [], (name, key, r[key])
            assert r["logit_diff_policy"] <= 1e-5 and r["logit_diff_reference"] <= 1e-5, (name, r)
            share = r["bytes_read"] / r["bytes_needed_whole"]
            if tp * pp == 1:  # a lone stage reads every tensor it needs once (the tied head: not at all)
                assert r["bytes_read"] == r["bytes_needed_whole"], (name, r)
            else:  # half the layers (PP) or half of every matrix (TP), plus small replicated pieces
                assert share < 0.6, (name, tp, pp, share)
