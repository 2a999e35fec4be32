"""tools/bench_lora.py: LoRA against full fine-tuning, side by side. --quick trains both arms on the
tiny model (two processes at once, 3 steps: about a minute on an idle 2-core machine, several when
other jobs share it) and passes; its negative control (the LoRA arm without model.lora, the full arm
reused) syncs the whole model and must exit 1 naming the sync check. Then the verdict's rules and the
--out refusal, in process, without training."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shared_helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
bl = load_tool("bench_lora")
TINY_PARAMS = 741_056  # examples/tiny/model's HF parameters (fp32: 4 bytes each)


def _bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "bench_lora.py"), "--quick", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-lora") / "out"
    return out, _bench(out)


def test_quick_measures_both_arms_and_passes(quick):
    out, res = quick
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "PASSED" in res.stdout
    result = json.loads((out / "bench_lora.json").read_text())
    full, lora = result["arms"]["full"], result["arms"]["lora"]
    assert result["reasons"] == [] and result["lora_arm"] == "lora"
    # The arms' commands: the same budget, LoRA's three settings on top; both at once, one thread each.
    ov = result["settings"]["overrides"]
    lora_only = {"model.lora.rank=16", "model.lora.alpha=32", "model.lora.sync=adapters", "optim.lr=0.0002"}
    lora_only.add("trainer.run_name=lora-s0")
    assert set(ov["lora"]) - set(ov["full"]) == lora_only
    assert "trainer.threads=1" in ov["full"] and "trainer.eval_every=3" in ov["full"]
    assert result["settings"]["parallel"] == 2
    # The numbers are the runs' own metrics: accuracy at step 0 and 3, step time over steps 2..3, sync bytes.
    for arm in (full, lora):
        rows = _metrics(out / f"{arm['arm']}-s0")
        evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
        assert sorted(evals) == [0, 3] and (arm["acc_before"], arm["acc_after"]) == (evals[0], evals[3])
        steps = [r for r in rows if "time/step" in r]
        assert arm["step_s"] == pytest.approx(sum(r["time/step"] for r in steps[1:]) / 2)
        assert arm["sync_bytes"] == pytest.approx(sum(r["sync/bytes"] for r in steps) / 3)
        assert arm["peak_rss_bytes"] > 200 * 2**20 and arm["checkpoint_bytes"] > 0
        assert not (out / f"{arm['arm']}-s0" / "checkpoints").exists()  # the final save measured, then deleted
    # The sync moves what the shapes say: every weight, or the adapters alone.
    assert full["trained_params"] == TINY_PARAMS and full["sync_bytes"] == full["planned_sync_bytes"] == 4 * TINY_PARAMS
    assert 0 < lora["sync_bytes"] == lora["planned_sync_bytes"] == 4 * lora["trained_params"] < full["sync_bytes"]
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"]
    md = (out / "bench_lora.md").read_text()
    assert "| weight-sync bytes a step |" in md and "| peak RSS, process + children |" in md
    assert (out / ".bench-lora").is_file()


def test_negative_control_fails_the_sync_check(quick):
    """The LoRA arm without model.lora syncs every weight: exit 1, the sync check named; the full arm is reused."""
    out, first = quick
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    res = _bench(out, "--negative-control", "full-sync")
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    assert "reusing 1 finished run(s)" in res.stdout
    line = f"weight sync moved {4 * TINY_PARAMS:,} bytes a step, not fewer than the full arm's {4 * TINY_PARAMS:,}"
    assert line in res.stdout
    control = json.loads((out / "negative_control.json").read_text())
    assert control["lora_arm"] == "lora-full-sync" and any(line in r for r in control["reasons"])
    assert json.loads((out / "bench_lora.json").read_text())["reasons"] == []  # the measurement's report kept


def _arm(name: str, **kw) -> dict:
    arm = dict(arm=name, returncode=0, finished=True, steps=30, acc_before=0.5, acc_after=0.55)
    return {**arm, "problems_scored": 64, "sync_bytes": 1000 if name == "full" else 10, "log": f"{name}.log", **kw}


@pytest.mark.parametrize(
    "lora, full, reason",
    [
        ({}, {}, None),
        ({"sync_bytes": 1000}, {}, "the lora arm's weight sync moved 1,000 bytes a step, not fewer than"),
        ({"sync_bytes": None}, {}, "no sync/bytes in the metrics of the lora arm(s)"),
        # 2 standard errors of a difference over 64 problems at p = 0.4: 2 sqrt(2 0.4 0.6 / 64) = 0.173
        ({"acc_after": 0.3}, {}, "the lora arm's held-out accuracy fell 0.500 -> 0.300, by more than the noise (0.173"),
        ({"acc_after": 0.35}, {}, None),  # a drop within the noise
        ({}, {"acc_before": 0.9, "acc_after": 0.7}, "the full arm's held-out accuracy fell 0.900 -> 0.700"),
        ({"returncode": 1, "finished": False, "steps": 2, "acc_after": None}, {}, "the lora arm failed (exit 1"),
    ],
)
def test_verdict(lora, full, reason):
    reasons = bl.verdict({"full": _arm("full", **full), "lora": _arm("lora", **lora)}, "lora", 30, 64)
    assert (reasons == []) if reason is None else (len(reasons) == 1 and reasons[0].startswith(reason)), reasons


def test_a_merged_sync_moves_the_full_models_bytes_by_design():
    """--sync merged: the LoRA arm streams merged full weights, so equal bytes pass there and only there."""
    arms = {"full": _arm("full"), "lora": _arm("lora", sync_bytes=_arm("full")["sync_bytes"])}
    assert bl.verdict(arms, "lora", 30, 64, "merged") == []
    assert bl.verdict(arms, "lora", 30, 64, "adapters")[0].startswith("the lora arm's weight sync moved")


def test_out_with_a_users_files_is_refused_before_anything_runs(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    assert bl.main(["--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --out {tmp_path} holds files this script did not write (it has no .bench-lora): "
        "choose a new or empty directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and mine.read_text() == "mine"
