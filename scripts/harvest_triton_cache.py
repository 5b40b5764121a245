"""Merge a Triton cache's autotune results and compiled kernels into a shipped seed archive
(``sp_attention/linear/tuned/sm<cc>_triton<T>_fla<F>.tgz``, read by
:mod:`sp_attention.linear.autotune_seeds`). Run on the GPU machine after a first step of each
model kind with ``TRITON_CACHE_DIR=DIR`` (and ``TRITON_CACHE_AUTOTUNING=1`` for our own
kernels' results), then carry the archive back:

    python scripts/harvest_triton_cache.py DIR --into ARCHIVE [--no-kernels]

Kept: ``<hash>/*.autotune.json``; with kernels, for every Triton group file whose kernel has a
``.cubin``, its metadata ``.json``, the ``.cubin`` and the group file (the PTX and other IRs stay
behind: Triton loads a kernel from metadata and binary). Existing members of the archive stay;
the archive is written deterministically (sorted, mtime 0)."""
from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path


def cache_files(cache: Path, kernels: bool = True) -> dict:
    """``{"<hash>/<file>": bytes}`` of what a seed archive ships from ``cache``."""
    out = {}
    for f in sorted(cache.glob("*/*.autotune.json")):
        out[f"{f.parent.name}/{f.name}"] = f.read_bytes()
    if not kernels:
        return out
    for grp in sorted(cache.glob("*/__grp__*.json")):
        try:
            children = json.loads(grp.read_text())["child_paths"]
        except (ValueError, KeyError):
            continue
        names = [c for c in children if c.endswith((".json", ".cubin"))]
        if not any(c.endswith(".cubin") for c in names) \
                or not all((grp.parent / c).is_file() for c in names):
            continue
        for c in names + [grp.name]:
            out[f"{grp.parent.name}/{c}"] = (grp.parent / c).read_bytes()
    return out


def merge(archive: Path, files: dict) -> tuple[int, int]:
    """Write ``archive`` with its existing members plus ``files`` (existing names win);
    ``(members before, after)``."""
    have = {}
    if archive.is_file():
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    have[m.name] = tar.extractfile(m).read()
    before = len(have)
    for name, data in files.items():
        have.setdefault(name, data)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in sorted(have):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(have[name]), 0
            tar.addfile(info, io.BytesIO(have[name]))
    return before, len(have)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="the Triton cache directory (TRITON_CACHE_DIR)")
    p.add_argument("--into", type=Path, required=True, help="the seed archive to create or extend")
    p.add_argument("--no-kernels", action="store_true", help="autotune results only")
    a = p.parse_args(argv)
    if not a.cache.is_dir():
        print(f"harvest: {a.cache} is not a directory", file=sys.stderr)
        return 2
    files = cache_files(a.cache, kernels=not a.no_kernels)
    before, after = merge(a.into, files)
    print(f"harvest: {len(files)} files from {a.cache}; {a.into}: {before} -> {after} members, "
          f"{a.into.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
