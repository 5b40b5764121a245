"""CPU dry run of benchmarks/packed_pieces.py: every row is produced, and the rank programs it
times compute the library's result (fp64 checks within 1e-10 of the per-document reference,
with and without gaps inside varlen calls)."""
import json
import sys

import pytest

from benchmarks import packed_pieces


def test_packed_pieces_dry_run(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x", "--dry-run", "--world", "2", "3"])
    packed_pieces.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    checks = [r for r in rows if r["impl"].startswith("check_")]
    assert checks and all(r["ok"] and r["rel_rms"] <= 1e-10 for r in checks)
    assert {r["impl"] for r in checks} >= {f"check_ranks_p{P}{g}_{w}" for P in (2, 3)
                                           for g in ("", "_nogaps")
                                           for w in ("out", "lse", "dq", "dk", "dv")}
    for P in (2, 3):
        progs = {r["impl"] for r in rows if r.get("rank") is not None and r["world"] == P}
        assert progs == {f"rank{r}_{n}" for r in range(P)
                         for n in ("kernels", "ring", "allgather", "ring_ag")}
    assert all(r["ms_fwd_bwd"] > 0 for r in rows if "ms_fwd_bwd" in r)
    assert any(r["impl"] == "baseline" for r in rows)


@pytest.mark.gpu
def test_packed_gpu_bf16_checks(capsys, monkeypatch):
    """On the GPU: the CP = 1 public op and every rank's program (P = 2, 3; varlen calls with
    and without gaps, dense calls) in bf16 vs the fp32 per-document reference, through the
    benchmark's own checks (error at most max(2 x the flash varlen kernel's, 1e-2))."""
    monkeypatch.setattr(sys, "argv", [
        "x", "--t-local", "2048", "--world", "2", "3", "--heads", "8", "--kv-heads", "2",
        "--head-dim", "64", "--warmup", "0", "--iters", "1", "--repeats", "1", "--no-flex",
        "--dense-min", "65536"])
    packed_pieces.main()          # exits non-zero on a failed check
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    checks = [r for r in rows if r["impl"].startswith("check_")]
    assert len(checks) == 2 * 15 and all(r["ok"] for r in checks)
