"""The README's quickstart test command is exactly what CI runs, and what the library's
documents point at exists."""
import fnmatch
import glob
import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    cmd = re.search(r"^TEST_CMD='(.*)'$", ci, re.M).group(1)
    assert cmd in open(os.path.join(ROOT, "README.md")).read()


# The documents: the top README, the package READMEs and the docstrings of the library, its
# adapters (megatron_patches, models), the trainer (sp_train), train.py and the example.
_PACKAGES = ("sp_attention", "megatron_patches", "models", "sp_train")
DOCS = (["README.md"]
        + [f for pkg in _PACKAGES
           for f in sorted(glob.glob(f"{pkg}/**/README.md", root_dir=ROOT, recursive=True))]
        + [f for pkg in _PACKAGES
           for f in sorted(glob.glob(f"{pkg}/**/*.py", root_dir=ROOT, recursive=True))]
        + ["train.py", "examples/hf_llama_cp.py"])
_REPO_DIRS = ("sp_attention/", "tests/", "benchmarks/", "megatron_patches/", "models/",
              "sp_train/", "scripts/", "examples/")
_PATH = re.compile(r"(?<![\w./-])([\w*-]+(?:/[\w.*-]+)*\.(?:py|md|sh|sbatch))\b")
_DOTTED = re.compile(r"(?<![\w/.])(?:sp_attention|sp_train)(?:\.[A-Za-z_]\w*)+")


def _repo_file_names() -> set:
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        names.update(files)
    return names


def _exists(path: str, here: str, names: set) -> bool:
    """``path`` (globs allowed) relative to the repo root or to the document's folder; a bare
    file name anywhere in the repo (code maps name a package's files without their folder)."""
    if any(glob.glob(os.path.join(base, path)) for base in (ROOT, os.path.join(ROOT, here))):
        return True
    return "/" not in path and bool(fnmatch.filter(names, path))


def test_files_named_in_the_library_docs_exist():
    missing, names = [], _repo_file_names()
    for doc in DOCS:
        here = os.path.dirname(doc)
        for m in _PATH.finditer(open(os.path.join(ROOT, doc), encoding="utf-8").read()):
            path = m.group(1)
            if "/" in path and not path.startswith(_REPO_DIRS):
                continue            # another project's file (fla/ops/..., torch/nn/...)
            if not _exists(path, here, names):
                missing.append(f"{doc}: {path}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith(("sp_attention", "sp_train")):
                return True         # needs an optional dependency that is not installed
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_modules_and_names_in_the_library_docs_exist():
    """``sp_attention.x.y`` / ``sp_train.x.y`` in the docs and ``:mod:`.x``` /
    ``:func:`.x.f``` in docstrings name a module or an attribute that exists."""
    missing = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        names = [m.group(0) for m in _DOTTED.finditer(text)]
        if doc.endswith(".py"):
            package = os.path.dirname(doc).replace("/", ".")
            for m in re.finditer(r":(?:mod|func|class|data|meth|attr):`~?(\.[\w.]+)`", text):
                rel = m.group(1)
                up = len(rel) - len(rel.lstrip("."))
                base = package.split(".")[:len(package.split(".")) - up + 1]
                names.append(".".join(base + [rel.lstrip(".")]))
        missing += [f"{doc}: {n}" for n in names if not _resolves(n)]
    assert not missing, "names that do not resolve:\n" + "\n".join(missing)


def _commands(text: str, marker: str) -> list:
    """The README's shell commands (code blocks, ``\\`` continuations joined) that run
    ``marker``, as argument lists after it."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].split("&&")[-1].strip()
            if marker in line.split():
                out.append(line.split()[line.split().index(marker) + 1:])
    return out


def test_the_readme_commands_are_ones_the_tests_run():
    """The Quickstart trains through ``python -m sp_train.torchrun`` (what
    tests/train/test_first_hour.py launches); every train.py and export_hf command in the
    README parses with their own parsers."""
    from sp_train.args import build_parser
    text = open(os.path.join(ROOT, "README.md")).read()
    assert ("pip install torch==2.13.0 -e \".[train]\" && python -m sp_train.torchrun "
            "--nproc-per-node 4 train.py") in text
    first_hour = open(os.path.join(ROOT, "tests", "train", "test_first_hour.py")).read()
    assert '"-m", "sp_train.torchrun", "--nproc-per-node"' in first_hour
    trains = _commands(text, "train.py")
    assert len(trains) >= 3
    for argv in trains:
        build_parser().parse_args([a for a in argv if a != "..."])
    exports = _commands(text, "sp_train.export_hf")
    assert exports and all("--load" in a and "--out" in a for a in exports)
    assert "examples/hf_llama_cp.py" in text and "models/README.md" in text
