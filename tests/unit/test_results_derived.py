"""tools/results_derived.py and tools/methods_report.py's method logs: the numbers docs/results.md
quotes outside the generated tables, on synthetic rows whose answers are computed here by hand."""

import sys
from pathlib import Path

import pytest
from shared_helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

rd = load_tool("results_derived")
mr = load_tool("methods_report")


def _row(name, cpu, cpu_se, acc, acc_se, curve, **kw):
    return {
        "method": name,
        "train_cpu_s": cpu,
        "train_cpu_se": cpu_se,
        "acc_final": acc,
        "acc_final_se": acc_se,
        "curve": [{"train_cpu_s": t, "acc_fit": a} for t, a in curve],
        **kw,
    }


GRPO = _row(
    "grpo", 100.0, 3.0, 0.40, 0.01, [(0, 0.3), (50, 0.38), (100, 0.40)],
    phase_time_s={"rollout": 40.0, "reward": 5.0, "logprob": 10.0, "train": 30.0, "sync": 3.0},
    train_time_s=100.0, tokens_trained=1000.0, prompts_kept_frac=1.0,
)  # fmt: skip


def test_bound_scales_rollout_by_prompts_kept_and_update_by_tokens():
    same = dict(GRPO, method="same")
    pruned = dict(GRPO, method="pruned", prompts_kept_frac=0.5, tokens_trained=250.0)
    lines = rd.bound({"grpo": GRPO, "same": same, "pruned": pruned}, ["same", "pruned"])
    assert lines[0].startswith("GRPO: rollout / update / rewards + sync + other = 40% / 40% / 20%")
    assert lines[1].endswith("bound 1.00x")
    # (40 + 5) * 0.5 + (10 + 30) * 0.25 + (100 - 85) = 22.5 + 10 + 15 = 47.5
    assert lines[2].endswith(f"bound {100 / 47.5:.2f}x")


def test_versus_is_against_the_named_base_not_grpo():
    base = _row("base", 200.0, 4.0, 0.50, 0.01, [(0, 0.3), (100, 0.45), (200, 0.50)])
    faster = _row("faster", 100.0, 2.0, 0.52, 0.02, [(0, 0.3), (50, 0.50), (100, 0.52)])
    (line,) = rd.versus({"grpo": GRPO, "base": base, "faster": faster}, ["base:faster"])
    se = 2.0 * ((4 / 200) ** 2 + (2 / 100) ** 2) ** 0.5
    assert line.startswith(f"faster vs base: CPU 2.00x +- {se:.2f}; acc +2.0 +- 2.2 points")
    assert line.endswith("at base's final accuracy (50.0%): 4.00x")  # 200 s against 50 s


def test_a_method_missing_from_the_json_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text('{"rows": [{"method": "grpo"}]}')
    with pytest.raises(SystemExit):
        rd.main(["bound", str(path), "dppo-0.5-0.5"])
    assert "has no rows for dppo-0.5-0.5 (it has grpo)" in capsys.readouterr().err


def test_method_logs_average_each_window_and_share_the_histogram():
    steps = [
        {"step": 1, "adaprefix/assisted_success": 0.2, "bppo/prefix_len/4-7": 3, "bppo/pair_abs_adv": 1.0},
        {"step": 2, "adaprefix/assisted_success": 0.4, "bppo/prefix_len/4-7": 1, "bppo/prefix_len/8-15": 4},
        {"step": 3, "bppo/pair_abs_adv": 0.5},  # no group assisted: the window's mean skips it
        {"step": 4, "adaprefix/assisted_success": 1.0},
    ]
    logs = mr.method_logs(steps, [(1, 3), (4, 4)])
    assert logs["adaprefix/assisted_success@1-3"] == pytest.approx(0.3)
    assert logs["adaprefix/assisted_success@4-4"] == pytest.approx(1.0)
    assert logs["bppo/pair_abs_adv"] == pytest.approx(0.75)
    assert logs["bppo/prefix_len_share/4-7"] == pytest.approx(0.5)
    assert logs["bppo/prefix_len_share/8-15"] == pytest.approx(0.5)
    assert sorted(logs, key=mr._log_order)[-2:] == ["bppo/prefix_len_share/4-7", "bppo/prefix_len_share/8-15"]
