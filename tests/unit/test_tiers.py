"""The test tiers (tests/conftest.py's TIERS) hold: every test file is in a tier folder, no unit test
asks for the fixtures that start workers, no test file imports another, and no two test files share
a basename (pytest imports them by basename, with each folder on sys.path)."""

import ast
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import TIERS, tier_of

TESTS = Path(__file__).resolve().parents[1]
WORKER_FIXTURES = {"torchrun", "launch"}


def _test_files(root: Path = TESTS) -> list[Path]:
    return sorted(root.rglob("test_*.py"))


def tier_problems(root: Path = TESTS) -> list[str]:
    """What breaks the tier rules under root (a tests/ folder), one line each."""
    problems = []
    files = _test_files(root)
    for path in files:
        rel = path.relative_to(root)
        if len(rel.parts) != 2 or rel.parts[0] not in TIERS:
            problems.append(f"{rel}: not in one of {sorted(TIERS)}")
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                problems.append(f"{rel}:{node.lineno}: imports {node.module} (shared helpers live in tests/)")
            if rel.parts[0] == "unit" and isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                asked = WORKER_FIXTURES & {a.arg for a in node.args.args}
                if asked:
                    problems.append(f"{rel}:{node.lineno}: {node.name} uses {sorted(asked)} (belongs in tests/dist)")
    for name, n in Counter(p.name for p in files).items():
        if n > 1:
            problems.append(f"{name}: {n} test files of this name")
    return problems


def test_the_tests_keep_to_their_tiers():
    assert tier_problems() == []
    assert {tier_of(p) for p in _test_files()} == set(TIERS)


def test_the_tier_check_finds_each_kind_of_problem(tmp_path):
    (tmp_path / "unit").mkdir()
    (tmp_path / "dist").mkdir()
    (tmp_path / "test_loose.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "unit" / "test_a.py").write_text("from test_b import X\n\n\ndef test_y(torchrun):\n    pass\n")
    (tmp_path / "dist" / "test_a.py").write_text("def test_z(launch):\n    pass\n")
    assert sorted(tier_problems(tmp_path)) == [
        "test_a.py: 2 test files of this name",
        "test_loose.py: not in one of ['dist', 'e2e', 'engine', 'unit']",
        "unit/test_a.py:1: imports test_b (shared helpers live in tests/)",
        "unit/test_a.py:4: test_y uses ['torchrun'] (belongs in tests/dist)",
    ]  # launch in tests/dist is what the tier is for


@pytest.fixture(scope="module")
def built_once_per_module():
    return object()


def test_a_test_with_a_module_fixture_shares_its_files_worker(request, built_once_per_module):
    """make test's pytest-xdist workers (--dist loadgroup): the tests of a file that use a module
    fixture are one group, so the fixture is built once; the others go to any free worker."""
    group = request.node.get_closest_marker("xdist_group")
    assert group is not None and group.args == ("unit/test_tiers.py",), group


def test_a_test_without_one_goes_to_any_worker(request):
    assert request.node.get_closest_marker("xdist_group") is None


def test_only_a_one_node_cli_launch_is_forked_as_ranks():
    """run_cli forks `python -m megatron_dppo.cli` (1 rank) and a one-node torchrun launch of it
    (--nproc_per_node ranks); anything torchrun would do more (several nodes, a rendezvous) or any
    other command stays a real process."""
    from conftest import _cli_ranks

    py = sys.executable
    cli = ["-m", "megatron_dppo.cli", "train", "--config", "c.yaml", "trainer.max_steps=2"]
    torchrun = [py, "-m", "torch.distributed.run"]
    assert _cli_ranks([py, *cli]) == (1, tuple(cli[2:]))
    one_node = [*torchrun, "--nproc_per_node=3", "--master_addr=127.0.0.1", "--master_port=29512", *cli]
    assert _cli_ranks(one_node) == (3, tuple(cli[2:]))
    for other in (
        [*torchrun, "--nnodes=2", "--nproc_per_node=2", *cli],  # several nodes: torchrun's rendezvous
        [*torchrun, "--nproc_per_node", "2", *cli],  # a flag form the parser does not read
        [*torchrun, "--nproc_per_node=2", "-m", "megatron_dppo.jobs.plan"],  # another module
        [*torchrun, "--nproc_per_node=2", "worker.py", "--steps", "2"],  # a script: no -m after torchrun's
        [py, "tools/compare_methods.py", "--quick"],
        ["/usr/bin/python3", *cli],  # another interpreter
    ):
        assert _cli_ranks(other) == (1, None), other
