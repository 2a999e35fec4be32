"""metrics.jsonl is strict JSON (issue 33): non-finite values are null, and every reader of the
file (run_log, tools/compare_methods, tools/methods_report through it) reads them back as NaN."""

import json
import math
import sys
from pathlib import Path

from megatron_dppo.config import load_config
from megatron_dppo.run.log import RunLogger, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import compare_methods  # noqa: E402  (tools/ is not a package)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_metrics_are_null_and_read_back_as_nan(tmp_path):
    cfg = load_config(overrides=["model.hf_dir=m", "data.train=t.jsonl"], check=False)
    cfg.logging.wandb, cfg.logging.tensorboard, cfg.logging.progress = "disabled", False, False
    logger = RunLogger(str(tmp_path), cfg, 2)
    logger.log({"step": 1, "train/aux_divergence": math.nan, "reward/mean": 0.25, "x/max": math.inf})
    logger.log({"step": 2, "train/aux_divergence": 0.5, "reward/mean": 0.5, "x/max": -math.inf})
    logger.close()  # plots the curves from the file (a reader too)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [_strict(line) for line in lines]  # a strict parser accepts every line
    assert [(r["train/aux_divergence"], r["x/max"]) for r in rows] == [(None, None), (0.5, None)]
    assert compare_methods.read_metrics is read_metrics  # one reader for the trainer's rows and the tools'
    for path in (str(tmp_path / "metrics.jsonl"), tmp_path / "metrics.jsonl"):
        back = read_metrics(path)
        assert math.isnan(back[0]["train/aux_divergence"]) and math.isnan(back[1]["x/max"])
        assert (back[0]["reward/mean"], back[1]["train/aux_divergence"]) == (0.25, 0.5)
    assert read_metrics(tmp_path / "not-yet.jsonl") == []  # a run before its first step
    assert (tmp_path / "curves.png").exists()
