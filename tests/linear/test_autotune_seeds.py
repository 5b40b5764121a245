"""The shipped fla autotune results unpack into Triton's cache safely (CPU: the GPU match is
stubbed; on a GPU machine benchmarks/first_call.py measures what they save)."""
import tarfile
from pathlib import Path

from sp_attention.linear import autotune_seeds

SHIPPED = sorted((Path(autotune_seeds.__file__).parent / "tuned").glob("sm90_*.tgz"))


def test_shipped_archive_holds_only_autotune_results():
    assert SHIPPED, "no shipped Hopper archive"
    with tarfile.open(SHIPPED[0]) as tar:
        files = [m for m in tar.getmembers() if m.isfile()]
    assert len(files) >= 20
    assert all(m.name.endswith(".autotune.json") and len(Path(m.name).parts) == 2 for m in files)


def test_install_writes_missing_files_only(tmp_path):
    def install():
        return autotune_seeds.install_autotune_seeds(SHIPPED[0], tmp_path)
    n = install()
    written = sorted(tmp_path.rglob("*.autotune.json"))
    assert n == len(written) >= 20
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
