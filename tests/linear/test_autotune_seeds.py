"""The shipped fla autotune results (and compiled kernels, where an archive holds them) unpack
into Triton's cache safely (CPU: the GPU match is stubbed; on a GPU machine
benchmarks/first_call.py measures what they save)."""
import io
import json
import tarfile
from pathlib import Path

from sp_attention.linear import autotune_seeds

SHIPPED = sorted((Path(autotune_seeds.__file__).parent / "tuned").glob("sm90_*.tgz"))


def test_shipped_archive_holds_only_cache_files():
    assert SHIPPED, "no shipped Hopper archive"
    with tarfile.open(SHIPPED[0]) as tar:
        files = [m for m in tar.getmembers() if m.isfile()]
    assert len([m for m in files if m.name.endswith(".autotune.json")]) >= 20
    assert all(autotune_seeds._shipped(Path(m.name)) for m in files)


def _archive(path: Path, files: dict) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_compiled_kernels_point_into_this_cache(tmp_path, monkeypatch):
    """A compiled kernel made elsewhere (its group file names that machine's paths and files
    not shipped, the PTX) is found by Triton's own cache lookup here, with its metadata and
    binary; members outside ``<hash>/<file>`` or of other kinds are not written."""
    triton_cache = __import__("pytest").importorskip("triton.runtime.cache")
    foreign = "/elsewhere/cache/ABC"
    group = {"child_paths": {f: f"{foreign}/{f}" for f in ("k.json", "k.cubin", "k.ptx")}}
    arch = _archive(tmp_path / "a.tgz", {
        "ABC/k.json": b'{"name": "k"}', "ABC/k.cubin": b"\x7fELF",
        "ABC/__grp__k.json": json.dumps(group).encode(), "ABC/launcher.so": b"x",
        "../evil.json": b"{}", "deep/er/x.json": b"{}"})
    root = tmp_path / "cache"
    assert autotune_seeds.install_autotune_seeds(arch, root) == 3
    assert sorted(p.name for p in (root / "ABC").iterdir()) == ["__grp__k.json", "k.cubin",
                                                                 "k.json"]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    got = triton_cache.FileCacheManager("ABC").get_group("k.json")
    assert got == {"k.json": str(root / "ABC" / "k.json"), "k.cubin": str(root / "ABC" / "k.cubin")}
    assert autotune_seeds.install_autotune_seeds(arch, root) == 0


def test_a_broken_group_file_costs_only_itself(tmp_path):
    arch = _archive(tmp_path / "b.tgz", {"ABC/k.json": b"{}", "ABC/__grp__k.json": b"not json"})
    assert autotune_seeds.install_autotune_seeds(arch, tmp_path / "cache") == 1
    assert not (tmp_path / "cache" / "ABC" / "__grp__k.json").exists()


def test_install_writes_missing_files_only(tmp_path):
    def install():
        return autotune_seeds.install_autotune_seeds(SHIPPED[0], tmp_path)
    n = install()
    assert n == sum(1 for f in tmp_path.rglob("*") if f.is_file())
    written = sorted(tmp_path.rglob("*.autotune.json"))
    assert len(written) >= 20
    # the shipped compiled kernels: every group file names files of this cache that exist
    groups = list(tmp_path.rglob("__grp__*.json"))
    assert len(groups) >= 20 and len(list(tmp_path.rglob("*.cubin"))) == len(groups)
    for grp in groups:
        paths = json.loads(grp.read_text())["child_paths"].values()
        assert paths and all(Path(p).is_file() and Path(p).parent == grp.parent for p in paths)
    mine = written[0]
    mine.write_text("tuned by the user")
    assert install() == 0                       # nothing missing: nothing written
    assert mine.read_text() == "tuned by the user"
    assert not list(tmp_path.rglob("*.tmp*"))


def test_no_match_means_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SP_ATTENTION_AUTOTUNE_SEEDS", "0")
    assert autotune_seeds._seed_file() is None
    assert autotune_seeds.install_autotune_seeds() == 0
    assert not any(tmp_path.iterdir())


def test_harvest_then_install_round_trip(tmp_path):
    """scripts/harvest_triton_cache.py takes a cache's autotune results and compiled kernels
    (not their IRs, not a kernel missing its binary) into an archive that installs them."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "harvest", Path(__file__).parents[2] / "scripts" / "harvest_triton_cache.py")
    harvest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harvest)
    cache = tmp_path / "made"
    (cache / "H1").mkdir(parents=True)
    (cache / "H2").mkdir()
    (cache / "H1" / "k.autotune.json").write_text("{}")
    for f, data in (("k.json", "{}"), ("k.cubin", "bin"), ("k.ptx", "ptx")):
        (cache / "H2" / f).write_text(data)
    (cache / "H2" / "__grp__k.json").write_text(json.dumps(
        {"child_paths": {f: str(cache / "H2" / f) for f in ("k.json", "k.cubin", "k.ptx")}}))
    (cache / "H3").mkdir()                      # a group whose binary is gone: skipped
    (cache / "H3" / "__grp__j.json").write_text(json.dumps({"child_paths": {"j.cubin": "x"}}))
    arch = tmp_path / "seeds.tgz"
    assert harvest.main([str(cache), "--into", str(arch)]) == 0
    with tarfile.open(arch) as tar:
        assert sorted(tar.getnames()) == ["H1/k.autotune.json", "H2/__grp__k.json",
                                          "H2/k.cubin", "H2/k.json"]
    assert harvest.merge(arch, {"H1/k.autotune.json": b"new"}) == (4, 4)   # existing wins
    root = tmp_path / "cache"
    assert autotune_seeds.install_autotune_seeds(arch, root) == 4
    assert (root / "H1" / "k.autotune.json").read_text() == "{}"
    grp = json.loads((root / "H2" / "__grp__k.json").read_text())["child_paths"]
    assert grp == {"k.json": str(root / "H2" / "k.json"), "k.cubin": str(root / "H2" / "k.cubin")}


# Each kernel whose compiled binary and autotune result the shipped archive holds, by its first
# line and a hash of its source: Triton keys both by the kernel's source *and its line number*
# in the file, so an edit above a kernel (an import added) silently voids its shipped entries —
# a fresh machine then compiles and autotunes it again (measured: four kernels recompiled in the
# twentieth session's first CP 2 step after two import lines moved them).
SHIPPED_KERNELS = {
    "sp_attention.linear.allgather_kernel._fold_kernel": (67, "69c6a7a067df"),
    "sp_attention.linear.allgather_kernel._stage_kernel": (44, "ef0d6e5b3ea7"),
    "sp_attention.linear.dqk_kernel._dqkdg_kernel": (37, "66525b02ab77"),
    "sp_attention.linear.dv_kernel._dv_kernel": (39, "6cbd640865d5"),
    "sp_attention.linear.gate_kernel._chunk_local_sums_kernel": (11, "f83e6bdd8966"),
    "sp_attention.linear.kernels._chunk_log_decays": (67, "73d97b87d6bd"),
    "sp_attention.linear.kernels._decayed_state_sum_kernel": (304, "91f4febb7662"),
    "sp_attention.linear.kernels._entering_state_kernel": (213, "b0036d26568a"),
    "sp_attention.linear.kernels._output_from_states_kernel": (84, "e9ac29fb6b09"),
    "sp_attention.softmax.merge_kernel._merge_kernel": (30, "98672a408104"),
    "sp_train.loss_kernels._grad_kernel": (59, "ccf5dcaf9a33"),
    "sp_train.loss_kernels._stats_kernel": (35, "bdc705019fe8"),
}


def test_shipped_kernels_keep_their_cache_keys():
    """Every kernel of the shipped archive still has the line and source its entries were made
    from. After a deliberate change: harvest the new entries on a GPU machine (``bash
    scripts/device_train.sh first_step``, then replace the archive) and update this table; after
    an accidental one (lines added above a kernel), restore the kernel's line."""
    import hashlib
    import importlib
    import inspect
    __import__("pytest").importorskip("triton", reason="the kernels need triton (gpu extra)")
    moved = []
    for path, (line, digest) in SHIPPED_KERNELS.items():
        mod, name = path.rsplit(".", 1)
        fn = getattr(importlib.import_module(mod), name)
        while hasattr(fn, "fn") and not hasattr(fn, "add_pre_run_hook"):
            fn = fn.fn                          # under autotune / heuristics
        lines, start = inspect.getsourcelines(fn.fn)
        got = (start, hashlib.sha256("".join(lines).encode()).hexdigest()[:12])
        if got != (line, digest):
            moved.append(f"{path}: line {line} -> {start}, source "
                         f"{'same' if got[1] == digest else 'changed'}")
    assert not moved, ("these kernels no longer match the shipped archive's compiled binaries "
                       "and autotune results (fresh machines compile and tune them again):\n"
                       + "\n".join(moved))


def test_installs_where_inductor_moves_tritons_cache(tmp_path, monkeypatch):
    """With ``TRITON_CACHE_DIR`` unset, torch's Inductor points it at its own per-device folder
    when a process loads its first compiled kernel (Megatron's fusions in train.py); the
    results and kernels go to Triton's default folder and to that one, so the lookups after the
    switch find them too. With it set, only there."""
    pytest = __import__("pytest")
    pytest.importorskip("triton")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    dirs = autotune_seeds._cache_dirs()
    assert dirs == [tmp_path / "home" / ".triton" / "cache", Path(triton_cache_dir(0))]
    assert dirs[1].is_relative_to(tmp_path / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    default = autotune_seeds._cache_dirs()[1]
    assert "TORCHINDUCTOR_CACHE_DIR" not in __import__("os").environ     # left as it was
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert default != dirs[1]
    arch = _archive(tmp_path / "a.tgz", {"ABC/k.autotune.json": b"{}"})
    assert autotune_seeds.install_autotune_seeds(arch) == 2
    assert all((d / "ABC" / "k.autotune.json").is_file() for d in dirs)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert autotune_seeds._cache_dirs() == [tmp_path / "mine"]
    assert autotune_seeds.install_autotune_seeds(arch) == 1
