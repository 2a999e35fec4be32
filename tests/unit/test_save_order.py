"""Issue 33: the order in which a step is written (checkpoint, metrics row, HF export), and what a
resume does after each stage fails or is killed. The real Trainer.train and Checkpoints.save /
export_hf run on a stub trainer (no model, no engine); the checkpoint writer is replaced by one that
writes only `latest`, as the real one does last."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

import megatron_dppo.megatron.checkpoint as ckpt_module
from megatron_dppo.config import load_config
from megatron_dppo.run.log import PENDING, RunLogger
from megatron_dppo.run.run_dir import RunDirPlan
from megatron_dppo.train.checkpointing import Checkpoints
from megatron_dppo.train.evaluation import Evaluation
from megatron_dppo.train.startup import RunPaths, check_hf_export_dir
from megatron_dppo.train.trainer import Trainer

MAX_STEPS = 3


class Killed(BaseException):
    """A kill at one stage of the save (BaseException: nothing in the loop may catch it)."""


def _cfg(tmp_path, **trainer):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    overrides = [f"model.hf_dir={model}", "data.train=t.jsonl", f"trainer.output_dir={tmp_path}"]
    overrides += ["logging.wandb=disabled", "logging.tensorboard=false", "logging.progress=false"]
    settings = {"max_steps": MAX_STEPS, "save_every": 1, "eval_every": 0, **trainer}
    overrides += [f"trainer.{k}={v}" for k, v in settings.items()]
    return load_config(overrides=overrides, check=False)


def _latest(run_dir) -> int:
    path = run_dir / "checkpoints" / "latest"
    return int(path.read_text().strip().split("_")[1]) if path.exists() else 0


def _trainer(cfg, run_dir, first_step: int) -> Trainer:
    """What Trainer.train reads, without a model: step() returns a row of its own step."""
    t = Trainer.__new__(Trainer)
    t.cfg, t.is_main, t.world, t.rank, t.engine_init_s, t.config_warnings = cfg, True, 1, 0, 0.0, []
    t.run_dir, t.ckpt_dir, t.first_step = str(run_dir), str(run_dir / "checkpoints"), first_step
    t.data = t.strategy = SimpleNamespace(skipped_long=0, state_dict=dict)
    t.curriculum, t.history, t.roles, t.pending = None, None, None, []
    t.policy = SimpleNamespace(attention=SimpleNamespace(describe=str), hf_weight_buckets=lambda: iter([]))
    t.weight_sync = SimpleNamespace(describe=str)  # the start-up line's LoRA part: "" without LoRA
    t.watchdog = SimpleNamespace(phase=lambda *a: None, margin_warning=lambda: None, timing_line=str)
    paths = RunPaths(RunDirPlan(t.run_dir, "resume"), t.ckpt_dir, {})
    t.checkpoints = Checkpoints(
        cfg,
        paths,
        policy=t.policy,
        data=t.data,
        strategy=t.strategy,
        curriculum=None,
        is_main=True,
        watchdog=t.watchdog,
    )
    t.evaluation = Evaluation(0, [], engines=None, renderer=None, run_dir=t.run_dir, is_main=True, watchdog=t.watchdog)
    t.step = lambda step: {"step": step, "reward/mean": step / 10}
    t.logger = RunLogger(str(run_dir), cfg, MAX_STEPS, first_step)
    return t


def _fake_save(kill_at_step=None):
    def save_checkpoint(root, step, *args, **kwargs):
        if step == kill_at_step:
            raise Killed(f"killed while saving step {step}'s checkpoint")
        os.makedirs(os.path.join(root, f"step_{step:06d}"), exist_ok=True)
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(f"step_{step:06d}\n")
        return os.path.join(root, f"step_{step:06d}")

    return save_checkpoint


def _run(cfg, run_dir, first_step, raises=None):
    t = _trainer(cfg, run_dir, first_step)
    try:
        if raises is None:
            t.train()
        else:
            with pytest.raises(raises) as e:
                t.train()
            return str(e.value)
    finally:
        t.logger.close()


def _steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", ["checkpoint", "after checkpoint", "metrics", "partial metrics line", "hf export"])
def test_each_stage_of_the_save_fails_and_the_resume_loses_no_step_and_repeats_none(tmp_path, monkeypatch, stage):
    """Step 2 fails (or is killed) at `stage`; then the run resumes from `latest` as --resume does
    (first step = latest + 1) and runs to the end: every step has exactly one row, and each row is
    that step's (a restored one without the save's cost). Before issue 33 the loop saved, exported
    and only then logged, so a failed export left `latest` at step 2 and step 2 without a row."""
    cfg = _cfg(tmp_path, save_hf_every=1 if stage == "hf export" else 0)
    run_dir = tmp_path / cfg.trainer.run_name
    run_dir.mkdir()
    monkeypatch.setattr(ckpt_module, "checkpoint_bytes", lambda path: 7)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", _fake_save(2 if stage == "checkpoint" else None))
    real_bytes, real_log = ckpt_module.checkpoint_bytes, RunLogger.log
    if stage == "after checkpoint":  # killed once `latest` names step 2, before the row is written

        def bytes_or_kill(path):
            if path.endswith("step_000002"):
                raise Killed("killed after saving step 2")
            return real_bytes(path)

        monkeypatch.setattr(ckpt_module, "checkpoint_bytes", bytes_or_kill)
    if stage in ("metrics", "partial metrics line"):

        def log_or_kill(self, metrics):
            if metrics["step"] == 2:
                if stage == "partial metrics line":
                    with open(self.metrics_path, "a") as f:
                        f.write('{"step": 2, "rew')
                raise Killed("killed while writing step 2's row")
            real_log(self, metrics)

        monkeypatch.setattr(RunLogger, "log", log_or_kill)
    if stage == "hf export":  # step 1 exports to hf/step_000001; then a file takes the name hf
        real_export_hf = Checkpoints.export_hf

        def export_hf(self, step):
            if step == 2:
                os.rename(run_dir / "hf", run_dir / "hf-old")
                (run_dir / "hf").write_text("not a directory")
            return real_export_hf(self, step)

        monkeypatch.setattr(Checkpoints, "export_hf", export_hf)

    message = _run(cfg, run_dir, 1, raises=OSError if stage == "hf export" else Killed)
    if stage == "hf export":
        assert message.startswith(
            f"config key 'trainer.save_hf_every': exporting step 2 as an HF model to {run_dir}/hf/step_000002 failed"
        ), message
    expected_latest = 1 if stage == "checkpoint" else 2
    assert _latest(run_dir) == expected_latest
    monkeypatch.setattr(RunLogger, "log", real_log)
    monkeypatch.setattr(ckpt_module, "checkpoint_bytes", lambda path: 7)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", _fake_save())
    if stage == "hf export":
        (run_dir / "hf").unlink()
    _run(cfg, run_dir, expected_latest + 1)

    assert _steps(run_dir) == [1, 2, 3]
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert all(rows[s]["reward/mean"] == s / 10 for s in rows)
    restored = stage in ("after checkpoint", "metrics", "partial metrics line")
    assert ("checkpoint/bytes" in rows[2]) == (not restored)  # a restored row lacks the save's cost
    assert not (run_dir / PENDING).exists()


def test_a_file_named_hf_in_the_run_dir_is_refused_at_start_naming_the_key(tmp_path):
    """The issue's case before any step: a resumed run dir holding a file `hf`."""
    from megatron_dppo.run.run_dir import RunDirPlan

    cfg = _cfg(tmp_path, save_hf_every=1)
    run_dir = tmp_path / cfg.trainer.run_name
    run_dir.mkdir()
    (run_dir / "hf").write_text("x")
    with pytest.raises(ValueError) as e:
        check_hf_export_dir(cfg, RunDirPlan(str(run_dir), "resume"))
    assert str(e.value) == (
        f"config key 'trainer.save_hf_every': HF exports go to {run_dir}/hf, which exists and is not a "
        "directory: move it away, or set trainer.save_hf_every=0"
    )
    check_hf_export_dir(cfg, RunDirPlan(str(run_dir), "replace"))  # --overwrite deletes it anyway


def test_a_step_repeated_after_a_resume_replaces_its_hf_export(tmp_path, monkeypatch):
    """save_every=2, save_hf_every=1: step 1 is exported, step 2 is killed in its checkpoint save, so
    the resume repeats step 1, whose export is there already (before: [Errno 17] File exists)."""
    cfg = _cfg(tmp_path, save_every=2, save_hf_every=1)
    run_dir = tmp_path / cfg.trainer.run_name
    run_dir.mkdir()
    monkeypatch.setattr(ckpt_module, "checkpoint_bytes", lambda path: 7)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", _fake_save(kill_at_step=2))
    _run(cfg, run_dir, 1, raises=Killed)
    assert _latest(run_dir) == 0 and (run_dir / "hf" / "step_000001" / "config.json").exists()
    (run_dir / "hf" / "step_000001" / "stale").write_text("from the first attempt")
    monkeypatch.setattr(ckpt_module, "save_checkpoint", _fake_save())
    _run(cfg, run_dir, 1)
    assert _steps(run_dir) == [1, 2, 3]
    assert sorted(os.listdir(run_dir / "hf")) == ["step_000001", "step_000002", "step_000003"]
    assert not (run_dir / "hf" / "step_000001" / "stale").exists()


def test_a_failed_hf_write_on_rank_0_still_iterates_every_bucket(tmp_path, monkeypatch):
    """The buckets' gathers are collective: rank 0 giving up at a failed shard write left the other
    ranks waiting in the next gather until the process group's timeout. It now consumes every
    bucket, then raises; nothing is left at the output path."""
    from megatron_dppo.megatron import weights

    consumed = []

    def buckets():
        for i in range(4):
            consumed.append(i)
            yield [(f"w{i}", torch.zeros(4))]

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "save_file", full_disk)
    out = tmp_path / "hf" / "step_000001"
    with pytest.raises(OSError, match="No space left"):
        weights.save_hf_checkpoint(buckets(), str(out), "examples/tiny/model", is_main=True, max_shard_bytes=1)
    assert consumed == [0, 1, 2, 3]
    assert not out.exists()
