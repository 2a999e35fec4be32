"""tools/compare_methods.py: the method table is complete and every method's config is valid (no
process), the report computes its speedups from the GRPO runs of the same comparison (synthetic
runs). --quick's training runs end to end: tests/e2e/test_compare_methods_quick.py."""

import json
from pathlib import Path

import pytest
from shared_helpers import load_tool

REPO = Path(__file__).resolve().parents[2]
CONFIG = "examples/tiny/addition.yaml"
cm = load_tool("compare_methods")
nd = load_tool("numerics_diff")

REQUIRED = [
    "grpo",
    "dppo-0.5-0.5",
    "dppo-0-0.5",
    "dppo-0.5-0",
    "dppo-0.3-0.3",
    "dppo-0.7-0.7",
    "dppo-0.9-0.9",
    "reverse-0.5-0.5",
    "dppo-0.5-0.5-padded",
    "cppo-0.5",
    "greso-0.5",
    "dapo",
    "dapo-dppo-0.5-0.5",
    "gspo",
    "gspo-dppo-0.5-0.5",
]
# The end-to-end test trains few methods (each is a ~20-40 s process start-up) that between them take
# every branch the comparison adds: no pruning, DPPO's two levels, padded packing, the two biased
# baselines, dynamic sampling. Every other method's config is validated by the dry run.


def _args(*extra):
    return cm.build_parser().parse_args(["--config", CONFIG, *extra])


def _resolved(method, quick=False):
    from megatron_dppo.config import load_config

    args = _args(*(["--quick"] if quick else []))
    args.threads = 1
    run = next(r for r in cm.plan_runs(args, cm.METHODS, [0], Path("/tmp/x")) if r.method == method)
    return load_config(str(REPO / CONFIG), run.overrides)


def test_every_method_is_planned_and_its_config_is_valid(capsys):
    assert [m["name"] for m in cm.METHODS if m.get("default", True)] == REQUIRED
    assert cm.main(["--config", CONFIG, "--dry-run", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "30 runs (15 methods x 2 seeds), all configs valid" in out
    for name in REQUIRED:
        assert f"{name}-s0 " in out and f"{name}-s1 " in out
    assert (
        cm.main(
            ["--config", CONFIG, "--dry-run", "--quick", "--methods", "grpo-nofilter,cppo-group-0.5,greso-simple-0.5"]
        )
        == 0
    )


@pytest.mark.parametrize("config", ["examples/tiny/addition.yaml", "examples/tiny/longtail.yaml"])
def test_the_seed_methods_are_planned_with_their_task_settings(capsys, config):
    """BPPO, ReCo, AdaPrefix, SSOPD (and BPPO / SSOPD with DPPO) on both tiny tasks: every config valid,
    AdaPrefix's reference and step boundaries the task's own."""
    assert cm.main(["--config", config, "--dry-run", "--methods", cm.SEED_METHOD_NAMES]) == 0
    out = capsys.readouterr().out
    assert "14 runs (7 methods x 2 seeds), all configs valid" in out
    ada = next(line for line in out.splitlines() if line.startswith("adaprefix-s0 "))
    key = "data.solution_key=answer" if "addition" in config else "data.solution_key=solution"
    assert key in ada and "algorithm.curriculum=adaprefix" in ada


def test_methods_resolve_to_what_their_names_say():
    grpo = _resolved("grpo")
    # The YAML's own choices (DPPO 0.5/0.5, clip_high 0.28, a time budget) are reset to GRPO's.
    assert (grpo.pruning.strategy, grpo.pruning.r_q, grpo.pruning.r_o) == ("none", 0.0, 0.0)
    assert (grpo.algorithm.clip_low, grpo.algorithm.clip_high, grpo.algorithm.loss_agg) == (0.2, 0.2, "token-mean")
    assert grpo.trainer.max_time_s == 0 and grpo.trainer.max_steps == cm.DEFAULT_STEPS
    assert grpo.trainer.eval_size == 500 and grpo.logging.wandb == "disabled" and not grpo.logging.progress
    d = _resolved("dppo-0.3-0.3")
    assert (d.pruning.strategy, d.pruning.r_q, d.pruning.r_o) == ("dppo", 0.3, 0.3)
    assert _resolved("dppo-0.5-0.5-padded").trainer.packing == "padded"
    assert _resolved("reverse-0.5-0.5").pruning.strategy == "reverse"
    assert (_resolved("cppo-0.5").pruning.strategy, _resolved("cppo-0.5").pruning.r_o) == ("cppo", 0.5)
    greso = _resolved("greso-0.5")
    assert (greso.pruning.strategy, greso.pruning.r_q, greso.algorithm.dynamic_sampling) == ("greso", 0.5, True)
    assert (greso.algorithm.clip_high, greso.algorithm.loss_agg) == (0.2, "token-mean")  # GRPO's, as their scripts
    assert _resolved("cppo-group-0.5").pruning.strategy == "cppo-group"
    assert _resolved("greso-simple-0.5").pruning.strategy == "greso-simple"
    # --quick: CPPO draws 2B = 16 and GRESO 1.5B = 12 prompts a round, so their training set is one draw.
    from megatron_dppo.algorithms.pruning import get_strategy

    for name in ("cppo-0.5", "greso-0.5", "grpo"):
        q = _resolved(name, quick=True)
        draw = get_strategy(q.pruning.strategy).prompts_to_draw(
            q.trainer.prompts_per_step, q.pruning.r_q, q.pruning.r_o
        )
        assert q.data.train_size == max(8, draw), name
    dapo = _resolved("dapo-dppo-0.5-0.5")
    assert dapo.algorithm.dynamic_sampling and dapo.algorithm.clip_high == 0.28
    assert dapo.algorithm.loss_agg == "token-mean" and dapo.pruning.strategy == "dppo"
    gspo = _resolved("gspo")
    assert gspo.algorithm.ratio_type == "sequence" and gspo.algorithm.loss_agg == "seq-mean-token-mean"
    assert (gspo.algorithm.clip_low, gspo.algorithm.clip_high) == (3e-4, 4e-4) and gspo.pruning.strategy == "none"
    q = _resolved("grpo", quick=True)
    assert (q.trainer.max_steps, q.trainer.prompts_per_step, q.rollout.group_size, q.trainer.eval_size) == (2, 8, 4, 20)


def test_seeds_methods_and_interleaving():
    assert cm.parse_seeds("2") == [0, 1] and cm.parse_seeds("3,5") == [3, 5]
    assert [m["name"] for m in cm.select_methods("cppo-0.5")] == ["grpo", "cppo-0.5"]  # GRPO always added
    with pytest.raises(ValueError, match="unknown method"):
        cm.select_methods("nope")
    args = _args("--methods", "dppo-0.5-0.5,cppo-0.5")
    args.threads = 1
    names = [r.name for r in cm.plan_runs(args, cm.select_methods(args.methods), [0, 1], Path("/tmp/x"))]
    assert names == ["grpo-s0", "dppo-0.5-0.5-s0", "cppo-0.5-s0", "cppo-0.5-s1", "dppo-0.5-0.5-s1", "grpo-s1"]


def test_train_cpu_time_skips_evaluation_steps():
    rows = [{"step": 0, "eval/accuracy": 0.3}] + [{"step": s, "time/step": 1.0} for s in range(1, 5)]
    rows[2]["eval/accuracy"] = 0.31
    marks = {0: 10.0, 1: 11.0, 2: 14.0, 3: 15.0, 4: 16.0}  # step 2 also evaluated (+2 s)
    assert sum(cm.step_cpu_times(rows, marks).values()) == pytest.approx(4.0)
    assert cm.step_cpu_times(rows, {0: 10.0, 4: 16.0}) is None  # too few steps measured


def test_isotonic_fit_and_time_to_target():
    assert cm.isotonic([0.3, 0.35, 0.33, 0.4]) == pytest.approx([0.3, 0.34, 0.34, 0.4])
    curve = [(0.0, 0.3), (10.0, 0.34), (20.0, 0.4)]
    assert cm.time_to_target(curve, 0.37) == pytest.approx(15.0)
    assert cm.time_to_target(curve, 0.3) == 0.0
    assert cm.time_to_target(curve, 0.41) is None


def _fake_run(out: Path, args, run, step_time: float, accs: list[float], eval_every: int):
    """A finished run as the trainer and compare_methods would leave it."""
    run.run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    steps = args.steps
    marks, cpu = {"0": 20.0}, 20.0
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "time/step": step_time,
            "time/rollout": step_time / 4,
            "time/train": step_time / 2,
            "tokens/generated": 100,
            "tokens/trained": 150,
            "train/tokens": 50.0,
            "train/optimizer_steps": 1,
            "prune/prompts_kept_frac": 1.0,
            "prune/completions_kept_frac": 0.5,
            "pack/density": 0.8,
        }
        cpu += step_time / 2  # the step's work; an evaluation adds 5 s more
        if s % eval_every == 0:
            row["eval/accuracy"] = accs[s // eval_every]
            cpu += 5.0
        marks[str(s)] = cpu
        rows.append(row)
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run.run_dir / cm.DONE_FILE).write_text(
        json.dumps(
            {
                "overrides": run.overrides,
                "returncode": 0,
                "process_wall_s": 30.0 + steps * step_time,
                "cpu_marks": marks,
            }
        )
    )


def test_speedup_is_against_grpo_of_the_same_comparison(tmp_path, monkeypatch):
    monkeypatch.setattr(cm, "REPO", tmp_path)  # never write docs/ from a test
    base = [
        "--config",
        str(REPO / CONFIG),
        "--methods",
        "dppo-0.5-0.5,cppo-0.5",
        "--seeds",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--threads",
        "1",
        "--no-docs",
    ]
    out = tmp_path / "cmp"
    args = _args(*base[2:], "--out-dir", str(out))
    methods = cm.select_methods(args.methods)
    runs = cm.plan_runs(args, methods, [0, 1], out)
    times = {
        ("grpo", 0): 1.0,
        ("grpo", 1): 1.2,
        ("dppo-0.5-0.5", 0): 0.5,
        ("dppo-0.5-0.5", 1): 0.7,
        ("cppo-0.5", 0): 0.8,
        ("cppo-0.5", 1): 0.8,
    }
    accs = {"grpo": [0.3, 0.32, 0.36], "dppo-0.5-0.5": [0.3, 0.35, 0.37], "cppo-0.5": [0.3, 0.31, 0.33]}
    for r in runs:
        _fake_run(out, args, r, times[(r.method, r.seed)], accs[r.method], 2)
    # A GRPO run of another comparison (other settings) must not be used.
    other = tmp_path / "other"
    oargs = _args(*base[2:], "--out-dir", str(other))
    _fake_run(other, oargs, cm.plan_runs(oargs, methods[:1], [0], other)[0], 100.0, accs["grpo"], 2)

    assert cm.main(base + ["--out-dir", str(out), "--report-only"]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    grpo_t = (4 * 1.0 + 4 * 1.2) / 2
    assert rows["grpo"]["train_time_s"] == pytest.approx(grpo_t)
    assert rows["grpo"]["speedup"] == pytest.approx(1.0)
    assert rows["dppo-0.5-0.5"]["speedup"] == pytest.approx(grpo_t / ((4 * 0.5 + 4 * 0.7) / 2))
    assert rows["cppo-0.5"]["speedup"] == pytest.approx(grpo_t / 3.2)
    # CPU time: evaluation steps left out, the other steps' CPU scaled to all steps.
    assert rows["grpo"]["train_cpu_s"] == pytest.approx(grpo_t / 2)
    assert rows["cppo-0.5"]["speedup_cpu"] == pytest.approx(grpo_t / 3.2)
    assert rows["dppo-0.5-0.5"]["acc_final"] == pytest.approx(0.37) and rows["dppo-0.5-0.5"]["acc_final_se"] == 0
    assert rows["dppo-0.5-0.5"]["acc_delta_vs_grpo"] == pytest.approx(0.01)
    # Target 0.36 (GRPO's final): GRPO reaches it at its end (4.4 s), DPPO between its evals 1 and 2.
    assert res["target_acc"] == pytest.approx(0.36)
    assert rows["grpo"]["time_to_target_s"] == pytest.approx(grpo_t)
    assert rows["dppo-0.5-0.5"]["time_to_target_s"] == pytest.approx(1.2 + 0.5 * 1.2)
    assert rows["cppo-0.5"]["time_to_target_s"] is None
    assert not res["partial"]
    md = (out / "results.md").read_text()
    assert "| DPPO (0.5, 0.5) | 2.4 | 1.83x |" in md and "| GRPO | 4.4 | 1.00x |" in md
    assert (out / "results.png").stat().st_size > 0

    # A run whose overrides changed is not reused (and reported as missing: partial).
    dppo_s1 = next(r for r in runs if r.name == "dppo-0.5-0.5-s1")
    assert cm.run_is_done(dppo_s1, 4)
    info = json.loads((dppo_s1.run_dir / cm.DONE_FILE).read_text())
    (dppo_s1.run_dir / cm.DONE_FILE).write_text(json.dumps(dict(info, overrides=info["overrides"][:-1])))
    assert not cm.run_is_done(dppo_s1, 4)
    cm.main(base + ["--out-dir", str(out), "--report-only"])
    res = json.loads((out / "results.json").read_text())
    assert res["partial"] and res["runs_finished"] == 5
    assert "PARTIAL RESULTS: 5 of 6 runs finished" in (out / "results.md").read_text()


def test_markdown_keeps_the_hand_written_discussion(tmp_path):
    md = tmp_path / "results.md"
    md.write_text(f"# Title\n\nintro\n\n{cm.GEN_BEGIN}\nold table\n{cm.GEN_END}\n\n## Discussion\nkept\n")
    cm.write_markdown(md, "new table\n", "results.png")
    text = md.read_text()
    assert "old table" not in text and "new table" in text and "## Discussion\nkept" in text and "intro" in text


def test_a_second_task_gets_its_own_block(tmp_path):
    """--docs-name results_longtail: its block is appended once, then rewritten in place; the
    first task's block and the hand-written text around both stay."""
    md = tmp_path / "results.md"
    md.write_text(f"intro\n\n{cm.GEN_BEGIN}\naddition table\n{cm.GEN_END}\n\nmiddle\n")
    cm.write_markdown(md, "longtail v1\n", None, "results_longtail")
    begin, end = cm.markers("results_longtail")
    assert md.read_text().count(begin) == 1 and "longtail v1" in md.read_text()
    md.write_text(md.read_text() + "\nafter\n")
    cm.write_markdown(md, "longtail v2\n", "results_longtail.png", "results_longtail")
    cm.write_markdown(md, "addition v2\n", None)
    text = md.read_text()
    assert "longtail v1" not in text and "addition table" not in text
    assert text.index("intro") < text.index("addition v2") < text.index("middle") < text.index("longtail v2")
    assert text.rstrip().endswith("after") and "results_longtail.png" in text


def _goal_row(name, speedup_at_target, delta):
    return {
        "method": name,
        "label": name,
        "speedup_at_target_cpu": speedup_at_target,
        "speedup_cpu": 1.0,
        "acc_delta_vs_grpo": delta,
        "acc_delta_se": None,
    }


def test_goals_say_plainly_which_are_met():
    rows = [_goal_row("grpo", 1.0, 0.0), _goal_row("dppo-0.5-0.5", 1.7, -0.02), _goal_row("dppo-0.7-0.7", 2.1, -0.02)]
    lines = cm.goals_table({"rows": rows})
    verdict = {ln.split("|")[1].strip(): ln.split("|")[-2].strip() for ln in lines if ln.startswith("| dppo")}
    assert verdict["dppo-0.5-0.5"] == "yes"  # no accuracy bound on this goal
    assert verdict["dppo-0.7-0.7"].startswith("no: final accuracy more than 1 point")
    rows[1] = _goal_row("dppo-0.5-0.5", None, -0.01)
    rows[2] = _goal_row("dppo-0.7-0.7", 1.5, 0.0)
    lines = cm.goals_table({"rows": rows})
    verdict = {ln.split("|")[1].strip(): ln.split("|")[-2].strip() for ln in lines if ln.startswith("| dppo")}
    assert verdict["dppo-0.5-0.5"] == "no: never reaches GRPO's final accuracy"
    assert verdict["dppo-0.7-0.7"] == "no: 1.50x < 2.0x"


def test_numerics_diff_sees_a_changed_count_and_ignores_times(tmp_path):
    """tools/numerics_diff.py on a committed table and copies of it: one with only times changed (no
    difference), one with a token count and an accuracy changed (both found, in those two runs)."""
    old = REPO / "docs" / "results_7757a29.json"
    data = json.loads(old.read_text())
    data["runs"][3]["train_cpu_s"] *= 2
    data["runs"][3]["curve"][1][1] += 5.0  # a time inside the curve
    timed = tmp_path / "times.json"
    timed.write_text(json.dumps(data))
    assert nd.differences(json.loads(old.read_text()), data) == []
    assert nd.main([str(old), str(timed)]) == 0
    data["runs"][5]["tokens_trained"] += 1
    data["runs"][6]["curve"][2][2] += 0.01  # an accuracy
    found = nd.differences(json.loads(old.read_text()), data)
    assert len(found) == 2 and "tokens_trained" in found[0] and "curve" in found[1]
    runs = data["runs"]
    assert nd.differing_runs(json.loads(old.read_text()), data) == sorted(
        (runs[k]["method"], runs[k]["seed"]) for k in (5, 6)
    )


def test_numerics_diff_names_a_changed_environment_without_counting_it(tmp_path, capsys):
    """Runs that record their environment (packages, processor): a different one is printed for
    both files, and is not a differing field; runs from before it was recorded are said to be."""
    data = json.loads((REPO / "docs" / "results_7757a29.json").read_text())
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    for r in data["runs"]:
        r["environment"] = {"packages": {"torch": "2.13.0+cpu"}, "cpu": "AMD EPYC"}
    old.write_text(json.dumps(data))
    for r in data["runs"]:
        r["environment"] = {"packages": {"torch": "2.13.0+cpu"}, "cpu": "Intel Xeon"}
    new.write_text(json.dumps(data))
    assert nd.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert f"environment of {old}:" in out and "Intel Xeon" in out and "0 differing fields" in out
    assert nd.main([str(old), str(old)]) == 0 and "environment" not in capsys.readouterr().out
    assert nd.main([str(REPO / "docs" / "results_7757a29.json"), str(new)]) == 0
    assert "environment: not recorded for every run" in capsys.readouterr().out


def test_the_tables_differ_from_their_previous_version_where_results_md_says():
    """docs/results.md: the addition table at d90d8f2 equals 7757a29's (docs/results_7757a29.json,
    itself equal to 5d75e64's) in 25 of its 32 runs; these 7 differ."""
    old, new = (json.loads((REPO / "docs" / name).read_text()) for name in ("results_7757a29.json", "results.json"))
    assert nd.differing_runs(old, new) == [
        ("cppo-0.5", 0),
        ("dppo-0.5-0.5", 2),
        ("dppo-0.5-0.5-padded", 1),
        ("greso-0.5", 0),
        ("greso-0.5", 2),
        ("greso-0.5", 3),
        ("grpo-padded", 1),
    ]


def test_the_numerics_moved_with_the_environment_not_the_code():
    """docs/results.md: the same runs from 7757a29, c3212b4, 7e6aac3 and d90d8f2, rerun on one day
    (docs/numerics_bisect.json), all equal the d90d8f2 tables and differ from 7757a29's own tables of
    2026-12-03; on the long-tailed task every one of the 32 runs moved."""
    docs = REPO / "docs"
    table = {name: json.loads((docs / f"{name}.json").read_text()) for name in ("results", "results_longtail")}
    earlier = {name: json.loads((docs / f"{name}_7757a29.json").read_text()) for name in table}
    bisect = json.loads((docs / "numerics_bisect.json").read_text())["runs"]
    assert sorted(bisect) == ["7757a29", "7e6aac3", "c3212b4", "d90d8f2"]
    for commit, tasks in bisect.items():
        for task, name in (("addition", "results"), ("longtail", "results_longtail")):
            if task not in tasks:
                continue
            assert tasks[task]["code_versions"] == [commit]
            assert nd.differences(tasks[task], table[name]) == [], (commit, task)
            assert nd.differing_runs(tasks[task], earlier[name]), (commit, task)
    assert len(nd.differing_runs(earlier["results_longtail"], table["results_longtail"])) == 32
