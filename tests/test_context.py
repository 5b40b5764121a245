"""``SPContext``, ``build_sp_context`` and the CP group's options (``sp_attention/context.py``)
without processes. Contexts of real groups (non-contiguous ranks, new_cp_group at world sizes
2 … 8): ``test_comm.py``'s spawned checks."""
import pytest
import torch.distributed as dist

from sp_attention.context import (CPGroupOptions, build_sp_context, new_cp_group,
                                  nccl_group_options)


def test_build_sp_context_bad_input():
    with pytest.raises(TypeError, match="ProcessGroup"):
        build_sp_context("world")
    with pytest.raises(ValueError, match="unknown layout"):
        build_sp_context(None, layout="diagonal")


def test_cp_group_options():
    assert nccl_group_options(CPGroupOptions(high_priority_stream=True), "gloo") is None
    assert nccl_group_options(CPGroupOptions(), "nccl") is None      # NCCL's own defaults
    with pytest.raises(ValueError, match="positive int"):
        CPGroupOptions(max_ctas=0)
    with pytest.raises(ValueError, match="min_ctas 8 > max_ctas 4"):
        CPGroupOptions(max_ctas=4, min_ctas=8)
    with pytest.raises(TypeError, match="bool"):
        CPGroupOptions(high_priority_stream=1)
    with pytest.raises(TypeError, match="CPGroupOptions"):
        new_cp_group([0], {"high_priority_stream": True})
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            new_cp_group([0])


@pytest.mark.skipif(not hasattr(dist, "ProcessGroupNCCL"), reason="this torch is built without "
                    "NCCL (CPU wheel); the options object exists only in CUDA builds")
def test_nccl_group_options_object():
    opts = nccl_group_options(CPGroupOptions(high_priority_stream=True, max_ctas=8, min_ctas=2),
                              "cpu:gloo,cuda:nccl")
    assert opts.is_high_priority_stream and opts.config.max_ctas == 8
    assert opts.config.min_ctas == 2
