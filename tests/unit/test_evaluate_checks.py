"""Issue 33: `evaluate` checks its model dir, its checkpoint and its output dir as `train` does,
before anything slow (the engine and the conversion are replaced by stubs that fail the test)."""

import os
import re
import shutil
from pathlib import Path

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.jobs import evaluate as evaluate_job

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny"


class Started(Exception):
    """The slow part was reached: the check under test did not stop the run."""


@pytest.fixture
def no_slow_parts(monkeypatch):
    import megatron_dppo.rollout as rollout

    def refuse(*args, **kwargs):
        raise Started("the engine or the conversion started")

    monkeypatch.setattr(rollout, "RolloutEngine", refuse)
    monkeypatch.setattr(evaluate_job, "convert_in_child", refuse)


def _cfg(tmp_path, hf_dir=TINY / "model"):
    overrides = [f"model.hf_dir={hf_dir}", f"data.eval={TINY / 'data' / 'test.jsonl'}", "data.train=unused"]
    overrides += [f"trainer.output_dir={tmp_path / 'runs'}", "reward.num_workers=1"]
    return load_config(str(TINY / "addition.yaml"), overrides)


def test_an_hf_dir_without_tokenizer_files_gets_trains_error(tmp_path, no_slow_parts):
    """Before: "The decoder prompt cannot be empty" from vLLM (evaluate skipped train's check)."""
    model = tmp_path / "model"
    shutil.copytree(TINY / "model", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ValueError, match=f"model.hf_dir {model} has no tokenizer files"):
        evaluate_job.run_evaluate(_cfg(tmp_path, model), out_dir=str(tmp_path / "out"))


def _converted_checkpoint(tmp_path, name, model) -> Path:
    """A real Megatron checkpoint of `model` (a transformers model), converted as a user would."""
    from megatron_dppo.megatron.convert_ckpt import hf_to_megatron_checkpoint

    hf_dir = tmp_path / f"{name}-hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    hf_to_megatron_checkpoint(str(hf_dir), str(tmp_path / name), log=lambda *a: None)
    return tmp_path / name


def test_a_moe_checkpoint_under_the_dense_config_is_refused(tmp_path, no_slow_parts):
    """Before: converted and evaluated, exit 0, the checkpoint never compared with model.hf_dir."""
    from tiny_models import tiny_qwen3_moe_model
    from transformers import AutoModelForCausalLM

    ckpt = _converted_checkpoint(tmp_path, "moe", tiny_qwen3_moe_model(0)[1])
    with pytest.raises(ValueError) as e:
        evaluate_job.run_evaluate(_cfg(tmp_path), checkpoint=str(ckpt), out_dir=str(tmp_path / "out"))
    message = str(e.value)
    assert message.startswith(
        f"--checkpoint {ckpt}: model.hf_dir={TINY / 'model'} is not the model the checkpoint was trained from "
        f"({ckpt / 'hf_config.json'}): its config.json differs (model_type 'qwen3_moe' -> 'qwen3', "
    ), message
    assert re.search(r"num_(local_)?experts 8 -> None", message), message
    dense = _converted_checkpoint(tmp_path, "dense", AutoModelForCausalLM.from_pretrained(TINY / "model"))
    with pytest.raises(Started):  # the same architecture passes the check
        evaluate_job.run_evaluate(_cfg(tmp_path), checkpoint=str(dense), out_dir=str(tmp_path / "out"))


def test_a_checkpoint_path_that_does_not_exist_says_so(tmp_path, no_slow_parts):
    """Before: "... has no model_optim/"."""
    missing = tmp_path / "runs" / "nope" / "checkpoints"
    with pytest.raises(FileNotFoundError) as e:
        evaluate_job.run_evaluate(_cfg(tmp_path), checkpoint=str(missing), out_dir=str(tmp_path / "out"))
    assert str(e.value).startswith(f"--checkpoint {missing} does not exist"), str(e.value)


def test_an_out_dir_that_cannot_be_written_is_named(tmp_path, no_slow_parts):
    """Before: a raw [Errno 17] / [Errno 20] line from the dump, after the engine ran."""
    (tmp_path / "a-file").write_text("x")
    cases = {
        str(tmp_path / "a-file"): f"--out-dir: {tmp_path / 'a-file'} exists and is not a directory",
        str(tmp_path / "a-file" / "sub"): f"--out-dir: {tmp_path / 'a-file' / 'sub'} cannot be written (",
        "/proc/megatron-dppo-evaluate": "--out-dir: /proc/megatron-dppo-evaluate cannot be written (",
    }
    for out_dir, message in cases.items():
        with pytest.raises(ValueError) as e:
            evaluate_job.run_evaluate(_cfg(tmp_path), out_dir=out_dir)
        assert str(e.value).startswith(message), str(e.value)
    cfg = _cfg(tmp_path)
    cfg.trainer.output_dir = str(tmp_path / "a-file")
    default = r"^trainer.output_dir \(evaluate writes to <output_dir>/<run_name>-evaluate\): "
    with pytest.raises(ValueError, match=default):
        evaluate_job.run_evaluate(cfg)
    assert not os.path.exists("/proc/megatron-dppo-evaluate")
