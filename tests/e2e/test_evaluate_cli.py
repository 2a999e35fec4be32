"""`megatron-dppo evaluate` on the tiny model: sampled from the HF dir (metrics = the dump's), and
greedy from a Megatron checkpoint of it (answers = transformers' own greedy answers)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from megatron_dppo.data.tasks import as_layout, write_parquet
from megatron_dppo.rollout.validation import metrics_from_rows

pytestmark = pytest.mark.slow  # two subprocesses with vLLM start-ups (~30 s each on an idle machine)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny"
COMMON = [
    "data.prompt_mode=chat",  # verl rows are chats; the tiny chat template gives the raw ids
    "trainer.eval_size=24",
    "trainer.threads=1",
    "logging.wandb=disabled",
]


def _evaluate(tmp_path, out, *args):
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "evaluate", "--config", str(TINY / "addition.yaml")]
    cmd += ["--out-dir", str(tmp_path / out), *COMMON, f"eval.sets={{verl: {tmp_path / 'verl.parquet'}}}", *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    res = run_cli(cmd, env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


def _rows(path):
    return [json.loads(line) for line in open(path)]


def _hf_greedy(prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY / "model")
    model = AutoModelForCausalLM.from_pretrained(TINY / "model", dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:  # one at a time: no padding to get wrong
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])  # the prompt has its <bos>
        with torch.no_grad():
            out = model.generate(
                ids, do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            )
        texts.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_evaluate_hf_dir_sampled_and_megatron_checkpoint_greedy(tmp_path):
    longtail = [json.loads(line) for line in open(TINY / "longtail" / "test.jsonl")][:8]
    add = [json.loads(line) for line in open(TINY / "data" / "test.jsonl")][100:116]
    write_parquet(
        as_layout(add, "verl", "add3") + as_layout(longtail, "verl", "mulsteps"), str(tmp_path / "verl.parquet")
    )

    # The HF dir, sampled: n=4 at temperature 1; the metrics are the dump's.
    screen = _evaluate(tmp_path, "hf", "eval.n=4", "eval.temperature=1.0", "eval.pass_k=[1,4]")
    rows = _rows(tmp_path / "hf" / "step_000000.jsonl")
    metrics = json.load(open(tmp_path / "hf" / "step_000000.metrics.json"))
    assert len(rows) == 4 * (24 + 24)  # data.eval's first 24, the verl set's 24
    assert metrics == pytest.approx(metrics_from_rows(rows, [1, 4], default_set="eval"))
    assert {"val/verl/add3/avg@4", "val/verl/mulsteps/pass@4", "val/verl/all/maj@4", "val/eval/all/pass@1"} <= set(
        metrics
    )
    assert metrics["val/eval/all/pass@4"] >= metrics["val/eval/all/pass@1"] > 0
    assert "set   data_source  avg@4" in screen and "verl  mulsteps" in screen
    assert len({r["completion"] for r in rows if r["index"] == 0 and r["set"] == "eval"}) > 1  # really sampled

    # The same model as a Megatron checkpoint, greedy: converted to a temporary HF dir (removed
    # after), and its answers are transformers' own on the HF weights (an independent implementation).
    from megatron_dppo.megatron.convert_ckpt import hf_to_megatron_checkpoint

    hf_to_megatron_checkpoint(str(TINY / "model"), str(tmp_path / "megatron"), log=lambda *a: None)
    _evaluate(tmp_path, "ckpt", "--checkpoint", str(tmp_path / "megatron"))
    greedy = _rows(tmp_path / "ckpt" / "step_000000.jsonl")
    assert [r["completion"] for r in greedy] == _hf_greedy([r["prompt"] for r in greedy])
    m1 = json.load(open(tmp_path / "ckpt" / "step_000000.metrics.json"))
    assert m1["eval/accuracy"] == sum(r["correct"] for r in greedy if r["set"] == "eval") / 24
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_000000.jsonl", "step_000000.metrics.json"]
