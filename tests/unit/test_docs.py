"""The front door and the docs site, without mkdocs (CI builds the site itself: `make docs` in .ci/run).

- docs/reference/config.md and cli.md are what tools/gen_reference.py writes from the code now; a
  schema key added without regenerating makes them differ.
- README.md stays short, its relative links point at files that exist, every command in its bash
  blocks is one a named test runs, and the rollout-correction kind it recommends is the code's.
- mkdocs.yml is strict and its nav lists every page under docs/ (and only those).
"""

import re
import shlex

import pytest
import yaml
from shared_helpers import REPO, load_tool

gen = load_tool("gen_reference")
README = (REPO / "README.md").read_text()

# Each command of README.md's bash blocks (its first words, after any VAR=value) -> the test that
# runs it, or ".ci/run" for a command CI runs as it is. A README command without an entry fails
# test_every_readme_command_is_run_by_a_test; so does an entry no README command uses.
README_COMMANDS = {
    "make main": "tests/e2e/test_trainer.py::test_tiny_run_accuracy_rises",
    "make test": ".ci/run",
    "make smollm2": (
        "tests/e2e/test_smollm2_tool.py::test_the_example_recipe_trains_the_real_model_and_tp3_equals_one_process"
    ),
    ".venv/bin/megatron-dppo train --config examples/tiny/addition.yaml pruning.strategy=none": (
        "tests/e2e/test_compare_methods_quick.py::test_quick_pipeline_end_to_end"
    ),
    ".venv/bin/megatron-dppo plan --config examples/presets/qwen2.5_7b_grpo.yaml": (
        "tests/unit/test_plan.py::test_table9_presets_fit_their_cluster"
    ),
    "torchrun --nproc_per_node 2 -m megatron_dppo.cli train --config examples/tiny/addition.yaml parallel.tp=2": (
        "tests/e2e/test_trainer_dist.py::test_tp2_one_engine_over_both_ranks_equals_one_process"
    ),
    "bash examples/qwen3_32b/launch_torchrun.sh": (
        "tests/e2e/test_launch.py::test_launch_script_runs_the_table9_presets"
    ),
    "bash examples/qwen3_32b/slurm.sbatch": (
        "tests/e2e/test_launch.py::test_slurm_dry_run_prints_every_nodes_torchrun_command"
    ),
    ".venv/bin/megatron-dppo train --config examples/tiny/longtail.yaml data.train=train.parquet": (
        "tests/e2e/test_trainer.py::test_a_verl_layout_recipe_trains_with_a_reward_per_source_and_validates"
    ),
    ".venv/bin/megatron-dppo evaluate --config examples/tiny/addition.yaml --checkpoint": (
        "tests/e2e/test_evaluate_cli.py::test_evaluate_hf_dir_sampled_and_megatron_checkpoint_greedy"
    ),
    ".venv/bin/megatron-dppo verify-unbiased": "tests/e2e/test_unbiased_cli.py::test_cli_exit_codes",
}


def bash_commands(markdown: str) -> list[list[str]]:
    """The commands of a page's ```bash blocks as words: continuations joined, comments and the
    leading VAR=value assignments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)
            if words:
                commands.append(words)
    return commands


def command_entry(words: list[str], table: dict) -> str | None:
    """The longest key of `table` whose words begin `words`."""
    matches = [key for key in table if words[: len(key.split())] == key.split()]
    return max(matches, key=len, default=None)


def missing_test(target: str, command: str) -> str | None:
    """Why `target` does not run `command`, or None: a test id's file must define the test, and
    .ci/run must hold the command."""
    if target == ".ci/run":
        return None if command in (REPO / ".ci/run").read_text().splitlines() else f".ci/run does not run {command!r}"
    path, _, name = target.partition("::")
    if not (REPO / path).is_file():
        return f"{target}: no file {path}"
    if not re.search(rf"^def {re.escape(name.split('[')[0])}\(", (REPO / path).read_text(), flags=re.M):
        return f"{target}: {path} defines no test {name}"
    return None


def unrun_commands(markdown: str, table: dict) -> list[str]:
    """Every problem: a command without an entry, an entry whose test is not there, an unused entry."""
    problems, used = [], set()
    for words in bash_commands(markdown):
        key = command_entry(words, table)
        if key is None:
            problems.append(f"no test named for README command: {shlex.join(words)}")
            continue
        used.add(key)
        problems.append(missing_test(table[key], key))
    problems += [f"README_COMMANDS entry no README command uses: {key}" for key in table if key not in used]
    return [p for p in problems if p]


# ---- generated reference pages ----------------------------------------------------------------


@pytest.mark.parametrize("page", sorted(gen.PAGES))
def test_the_generated_reference_pages_are_up_to_date(page):
    stale = f"{page} is stale: run .venv/bin/python tools/gen_reference.py"
    assert (REPO / page).read_text() == gen.PAGES[page](), stale


def test_a_schema_key_added_without_regenerating_makes_the_page_stale(tmp_path):
    """The schema with one more trainer key (a copy, loaded as its own module): the page it gives
    names the key and differs from the committed one, which is what the test above compares."""
    schema = (REPO / "megatron_dppo/config/schema.py").read_text()
    anchor = "    max_staleness: int = 0\n"
    assert anchor in schema
    changed = tmp_path / "schema_with_a_new_key.py"
    changed.write_text(schema.replace(anchor, anchor + "    new_knob: int = 3  # a key nobody documented\n"))
    page = gen.config_page(load_tool(changed).Config)
    assert "| `trainer.new_knob` | int | `3` | a key nobody documented |" in page
    assert page != (REPO / "docs/reference/config.md").read_text()


def test_the_config_page_has_every_key_with_its_comment():
    """Spot checks against the schema: a nested method key, a comment block above a key joined to
    its tail comment, a Literal's choices, a resolved (None) default."""
    page = (REPO / "docs/reference/config.md").read_text()
    assert "| `algorithm.bppo.wave_size` | int | `4` | g0 of schedule=waves |" in page
    assert "| `parallel.distributed_optimizer` | bool \\| null | `null` | resolved: on with CUDA, off on CPU |" in page
    assert "| `model.dtype` | `float32` \\| `bfloat16` | `float32` |" in page
    assert "the stall watchdog names the rank and phase it waits on and ends the job (exit 124)" in page


def test_the_cli_page_has_every_subcommand_and_the_plans_own_flags():
    page = (REPO / "docs/reference/cli.md").read_text()
    for name in ("train", "evaluate", "plan", "verify-unbiased"):
        assert f"## `megatron-dppo {name}`" in page
    assert "`--gen-tokens-per-s GEN_TOKENS_PER_S`" in page  # jobs/plan.py's parser, not cli.py's stub
    assert "| `--draws DRAWS` | Monte Carlo mask draws | default `4000` |" in page


# ---- README -----------------------------------------------------------------------------------


def test_the_readme_is_at_most_150_lines():
    assert len(README.splitlines()) <= 150, len(README.splitlines())


def test_every_relative_link_in_the_readme_exists():
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links nothing: the check would pass vacuously"
    assert [t for t in local if not (REPO / t).exists()] == []


def test_every_readme_command_is_run_by_a_test():
    assert len(bash_commands(README)) >= len(README_COMMANDS)
    assert unrun_commands(README, README_COMMANDS) == []


def test_the_command_check_finds_each_kind_of_problem():
    page = "```bash\nmake main\nFOO=1 make  unknown --x   # comment\n"
    page += ".venv/bin/megatron-dppo plan \\\n    --config a.yaml\n```\n"
    table = {
        "make main": "tests/unit/test_docs.py::test_no_such_test",
        ".venv/bin/megatron-dppo plan": ".ci/run",
        "make unused": ".ci/run",
    }
    assert bash_commands(page) == [
        ["make", "main"],
        ["make", "unknown", "--x"],
        [".venv/bin/megatron-dppo", "plan", "--config", "a.yaml"],
    ]
    assert unrun_commands(page, table) == [
        "tests/unit/test_docs.py::test_no_such_test: tests/unit/test_docs.py defines no test test_no_such_test",
        "no test named for README command: make unknown --x",
        ".ci/run does not run '.venv/bin/megatron-dppo plan'",
        "README_COMMANDS entry no README command uses: make unused",
    ]


def test_the_readme_recommends_the_codes_rollout_correction_in_one_place():
    """The kinds verify_rollout.RECOMMENDED_CORRECTION holds (the start-up warning's) are named on
    the one line marked <!-- recommendation --> and nowhere else; the line before links to
    docs/algorithm.md section 8, where they were measured."""
    from megatron_dppo.jobs.verify_rollout import RECOMMENDED_CORRECTION

    lines = README.splitlines()
    marked = [i for i, line in enumerate(lines) if "<!-- recommendation -->" in line]
    assert len(marked) == 1, marked
    assert "(docs/algorithm.md#8-" in lines[marked[0] - 1]
    named = re.findall(r"algorithm\.rollout_correction=(\w+)", README)
    assert set(named) == set(RECOMMENDED_CORRECTION.values()) and len(named) == len(set(named))
    assert sorted(re.findall(r"algorithm\.rollout_correction=(\w+)", lines[marked[0]])) == sorted(named)


# ---- the site's configuration -----------------------------------------------------------------


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_is_strict_and_its_nav_lists_every_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["strict"] is True and set(config["validation"].values()) == {"warn"}
    listed = nav_pages(config["nav"])
    on_disk = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(listed) == on_disk and len(listed) == len(set(listed))
