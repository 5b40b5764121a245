"""benchmarks/long_context.py without a GPU: the plan (every length and recompute setting,
estimates, predicted times; the longest rows from the estimate) and the first-loss check."""
import json

from benchmarks import long_context as lc

K = 1024


def test_plan_covers_the_grid_and_refused_rows_cost_nothing(capsys):
    rows = lc.plan(1, 512 * K) + lc.plan(2, 0, 576 * K)
    cells = {(r[0], r[1], r[2]) for r in rows if r[5] == "chunked"}
    for kind in ("softmax", "hybrid"):
        for seq in (4 * K, 32 * K, 64 * K, 128 * K, 256 * K):
            for mode in lc.RECOMPUTE:
                assert (kind, seq, mode) in cells, (kind, seq, mode)
    assert ("softmax", 32 * K, "none", 1, 2, "megatron", 3) in rows
    assert lc.predicted_s(("softmax", 256 * K, "none", 1, 1, "chunked", 2), 400, 7) == 0.5
    assert lc.predicted_s(("softmax", 256 * K, "full", 1, 1, "chunked", 2), 400, 7) > 60
    longest = lc.longest_by_estimate("softmax", 0.92 * 139.7)
    assert longest >= 256 * K and lc.estimate_gib(("softmax", longest, "full", 1, 1,
                                                   "chunked", 1)) <= 0.92 * 139.7
    assert lc.main(["--dry-run", "--part", "2"]) == 0
    plan = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert plan and all("estimate_gib" in p for p in plan)


def test_first_loss_check():
    def row(mode, loss):
        return {"status": "ok", "kind": "hybrid", "seq": 4 * K, "micro_batch": 4,
                "global_batch": 8, "loss_impl": "chunked", "recompute": mode, "first_loss": loss}
    assert lc.check_first_losses([row("none", 1.5), row("full", 1.5), row("selective", 1.5)]) \
        == []
    assert len(lc.check_first_losses([row("none", 1.5), row("full", 1.5000001)])) == 1
