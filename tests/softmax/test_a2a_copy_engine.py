"""The copy-engine exchange of the all-to-all presets (``sp_attention/peer_copy.py``,
``SoftmaxTuning(a2a_transport="copy_engine")``) on CPU: the same pull protocol over gloo with
the emulated symmetric memory (a barrier snapshots every rank's workspace). At every rank:
the exchange alone (blocks in their places, more exchanges than regions in flight, a workspace
grown by a larger exchange, groups of U < P; P = 1, 2, 3, 4, 6, 8), and ``a2a`` / ``a2a_ring`` through it against
the fp64 reference (P = 1, 2, 3, 4; both layouts; causal and not; head chunks 1 and 2)."""
import pytest
import torch
import torch.distributed as dist

from sp_attention import SoftmaxTuning, build_sp_context
from sp_attention.testing import run_distributed

from test_softmax_cp import _a2a_cases, _reference, _run_one


def _emulate():
    from sp_attention import peer_copy
    peer_copy.CPU_MEMORY = peer_copy.EmulatedPeerMemory
    return peer_copy


def _exchange_worker(rank, world):
    peer_copy = _emulate()
    ctx = build_sp_context(dist.new_group(list(range(world))))
    ex = peer_copy.peer_exchange(ctx, torch.device("cpu"))
    for U in [u for u in range(1, world + 1) if world % u == 0]:
        g0 = rank - rank % U
        pend = []
        # more exchanges than regions, then one that grows the workspace
        for i, n in enumerate([3, 5, 3, 7, 2, 4, (1 << 13) + 1]):
            # block j of rank r: value 1000·r + 10·j + i, for the group's rank j
            send = torch.stack([torch.full((n,), 1000.0 * rank + 10 * j + i,
                                           dtype=torch.float32) for j in range(U)])
            recv, p = ex.exchange(send, U)
            pend.append((recv, p, i, n))
        for recv, p, i, n in pend:
            p.wait()
            want = torch.stack([torch.full((n,), 1000.0 * (g0 + j) + 10 * (rank % U) + i)
                                for j in range(U)])
            assert torch.equal(recv, want), (U, i)
    assert ex.region_bytes >= ((1 << 13) + 1) * 4 * world
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_exchange_puts_every_block_in_place(world):
    assert all(run_distributed(_exchange_worker, world, timeout=300))


def _a2a_worker(rank, world):
    _emulate()
    from sp_attention.planning.softmax_a2a import head_chunk_counts
    group = dist.new_group(list(range(world)))
    for i, shape in enumerate(_a2a_cases(world)[:2]):
        for causal in (True, False):
            inputs, expected = _reference(shape, world, causal, 41 + 7 * i + causal)
            for layout in ("zigzag", "contiguous"):
                ctx = build_sp_context(group, layout=layout)
                runs = [dict(preset="a2a", tuning=SoftmaxTuning(a2a_transport="copy_engine",
                                                                a2a_head_chunks=c))
                        for c in head_chunk_counts(shape[2], shape[3], world) if c <= 2]
                if world == 4 and i == 0:
                    runs.append(dict(preset="a2a_ring", a2a_size=2,
                                     tuning=SoftmaxTuning(a2a_transport="copy_engine")))
                for kw in runs:
                    name = f"P={world} copy_engine {shape} causal={causal} {layout} {kw} rank{rank}"
                    _run_one(ctx, inputs, expected, causal, None, None, kw, name)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a2a_presets_through_the_copy_engine_exchange(world):
    assert all(run_distributed(_a2a_worker, world, timeout=300))


def test_copy_engine_on_cpu_names_the_fix():
    """Without CUDA (and without the tests' emulation) the transport raises before the op
    communicates, naming the setting that works."""
    from sp_attention import context_parallel_attention
    q = torch.randn(1, 4, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="a2a_transport='nccl'"):
        context_parallel_attention(q, q, q, ctx=None, preset="a2a",
                                   tuning=SoftmaxTuning(a2a_transport="copy_engine"))
    with pytest.raises(ValueError, match="a2a_transport"):
        SoftmaxTuning(a2a_transport="nvlink")
