"""The run dir (issue 24, item 1): --overwrite deletes only a run dir this project created, inside
trainer.output_dir; everything else is refused by name, and nothing outside the run dir is touched."""

import json
import os

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.run.run_dir import MARKER, RunDirError, plan_run_dir, prepare_run_dir


def tree(path) -> dict:
    """{relative path: file bytes or None for a dir} of everything under path."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), path)] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), path)] = fh.read()
    return out


@pytest.fixture
def project(tmp_path):
    """tmp/other-project/ (someone else's files) next to tmp/outer/runs/, our output dir, which holds
    one finished run of ours (marker + checkpoint) and a dir the user made by hand."""
    (tmp_path / "other-project").mkdir()
    (tmp_path / "other-project" / "thesis.tex").write_text("years of work")
    out = tmp_path / "outer" / "runs"
    (tmp_path / "outer" / "notes.txt").parent.mkdir(parents=True)
    (tmp_path / "outer" / "notes.txt").write_text("the parent of the output dir")
    ours = prepare_run_dir(str(out), "done", resume=False, overwrite=False)
    os.makedirs(os.path.join(ours, "checkpoints", "step_000003"))
    with open(os.path.join(ours, "checkpoints", "latest"), "w") as f:
        f.write("step_000003\n")
    (out / "mine").mkdir()
    (out / "mine" / "data.csv").write_text("the user's own")
    return tmp_path, out


@pytest.mark.parametrize(
    "name, why",
    [
        ("..", "'..' is not a directory of its own"),
        (".", "'.' is not a directory of its own"),
        ("", "it is empty"),
        ("a/b", "it contains the path separator '/'"),
        ("../other-project", "it contains the path separator '/'"),
    ],
)
def test_run_name_must_be_one_plain_component_and_nothing_is_deleted(project, name, why):
    tmp, out = project
    before = tree(tmp)
    with pytest.raises(RunDirError) as e:
        prepare_run_dir(str(out), name, resume=False, overwrite=True)
    msg = str(e.value)
    assert "\n" not in msg and f"trainer.run_name={name!r} is not a plain directory name ({why})" in msg, msg
    assert tree(tmp) == before
    # The config check refuses it too, before anything starts.
    with pytest.raises(ValueError, match=r"config key 'trainer.run_name': expected one plain directory name"):
        load_config("examples/tiny/addition.yaml", [f"trainer.run_name={name}"])


def test_symlink_out_of_the_output_dir_is_refused(project):
    tmp, out = project
    os.symlink(tmp / "other-project", out / "escape")
    before = tree(tmp)
    with pytest.raises(RunDirError, match=r"resolves to .*other-project, which is not inside trainer.output_dir"):
        prepare_run_dir(str(out), "escape", resume=False, overwrite=True)
    assert tree(tmp) == before and (tmp / "other-project" / "thesis.tex").exists()


def test_overwrite_deletes_only_a_dir_with_our_marker(project):
    tmp, out = project
    before = tree(tmp)
    with pytest.raises(RunDirError) as e:
        prepare_run_dir(str(out), "mine", resume=False, overwrite=True)
    assert f"{out / 'mine'} already exists and was not created by megatron-dppo (it has no {MARKER} marker)" in str(
        e.value
    )
    assert tree(tmp) == before
    # Ours is replaced: the old contents go, a fresh marker comes; nothing else changes.
    path = prepare_run_dir(str(out), "done", resume=False, overwrite=True)
    after = tree(tmp)
    done = "outer/runs/done"
    assert sorted(k for k in after if k.startswith(done)) == [done, f"{done}/{MARKER}"]
    assert {k: v for k, v in after.items() if not k.startswith("outer/runs/done")} == {
        k: v for k, v in before.items() if not k.startswith("outer/runs/done")
    }
    info = json.loads((out / "done" / MARKER).read_text())
    assert info["by"] == "megatron-dppo" and info["created"] and info["version"]
    assert path == os.path.join(str(out), "done")


def test_existing_run_needs_resume_or_overwrite_and_resume_needs_a_checkpoint(project):
    tmp, out = project
    with pytest.raises(RunDirError, match=r"already exists with checkpoints: pass --resume .* or --overwrite"):
        plan_run_dir(str(out), "done", resume=False, overwrite=False)
    assert plan_run_dir(str(out), "done", resume=True, overwrite=False).action == "resume"
    with pytest.raises(RunDirError, match=r"--resume: run dir .*/fresh does not exist, so there is nothing to resume"):
        plan_run_dir(str(out), "fresh", resume=True, overwrite=False)
    with pytest.raises(RunDirError, match=r"--resume and --overwrite contradict each other"):
        plan_run_dir(str(out), "done", resume=True, overwrite=True)


def test_a_failed_start_says_so_and_overwrite_starts_afresh(project):
    """A start that failed after writing something (config.yaml, a wandb dir) leaves our marker and no
    checkpoint: neither "pass --resume" nor, on --resume, "no checkpoint"."""
    tmp, out = project
    failed = prepare_run_dir(str(out), "failed", resume=False, overwrite=False)
    # Nothing written yet but the marker: the next start just reuses the dir.
    assert prepare_run_dir(str(out), "failed", resume=False, overwrite=False) == failed
    with open(os.path.join(failed, "config.yaml"), "w") as f:
        f.write("model: {}\n")
    for resume in (False, True):
        with pytest.raises(RunDirError) as e:
            plan_run_dir(str(out), "failed", resume=resume, overwrite=False)
        msg = str(e.value)
        assert "holds a run without a checkpoint: its start failed or it was stopped before its first save" in msg
        assert "pass --overwrite to start it afresh (safe: it carries this project's marker" in msg
        assert "pass --resume" not in msg
    prepare_run_dir(str(out), "failed", resume=False, overwrite=True)
    assert sorted(os.listdir(failed)) == [MARKER]


def test_a_legacy_run_dir_without_marker_still_resumes(project):
    """Run dirs of versions before the marker: --resume writes into them (deletes nothing), so it is allowed."""
    tmp, out = project
    os.makedirs(out / "old" / "checkpoints" / "step_000002")
    (out / "old" / "checkpoints" / "latest").write_text("step_000002\n")
    assert plan_run_dir(str(out), "old", resume=True, overwrite=False).action == "resume"
    with pytest.raises(RunDirError, match=r"not created by megatron-dppo"):
        plan_run_dir(str(out), "old", resume=False, overwrite=True)


def test_only_rank_0_writes(tmp_path):
    plan = plan_run_dir(str(tmp_path), "r", resume=False, overwrite=False)
    from megatron_dppo.run.run_dir import make_run_dir

    assert make_run_dir(plan, is_main=False) == str(tmp_path / "r") and not (tmp_path / "r").exists()
    make_run_dir(plan, is_main=True)
    assert (tmp_path / "r" / MARKER).exists()


def test_an_output_dir_that_cannot_hold_run_dirs_is_named_by_its_key(tmp_path):
    """Issue 33: a file, a path under a file, a path under /proc: raw errno lines before."""
    (tmp_path / "a-file").write_text("x")
    cases = {
        str(tmp_path / "a-file"): f"trainer.output_dir={str(tmp_path / 'a-file')!r} is not a directory (it holds",
        str(tmp_path / "a-file" / "runs"): f"trainer.output_dir={str(tmp_path / 'a-file' / 'runs')!r} is not a "
        f"directory: {tmp_path / 'a-file'} is a file (it holds",
        "/proc/megatron-dppo-runs": "trainer.output_dir: cannot create the run dir /proc/megatron-dppo-runs/r (",
    }
    for output_dir, message in cases.items():
        with pytest.raises(RunDirError) as e:
            prepare_run_dir(output_dir, "r", resume=False, overwrite=False)
        assert str(e.value).startswith(message), str(e.value)
    assert (tmp_path / "a-file").read_text() == "x"
