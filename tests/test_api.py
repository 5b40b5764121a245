"""The public API is pinned: adding or removing a name is a deliberate change of this test."""
import sp_attention
import sp_attention.comm
import sp_attention.linear


def test_top_level_api():
    assert sorted(sp_attention.__all__) == sorted([
        "__version__", "LAYOUTS", "DEFAULT_LAYOUT", "SPContext", "build_sp_context",
        "CPGroupOptions", "new_cp_group", "lightning_attention", "context_parallel_attention",
        "SoftmaxSchedule",
        "shard_sequence", "unshard_sequence", "shard_position_ids", "shift_labels",
        "pad_to_multiple", "pad_for_layout", "LinearTuning", "SoftmaxTuning",
        "PackingPlan", "plan_packing", "release_cuda_graphs"])
    for name in sp_attention.__all__:
        assert hasattr(sp_attention, name), name


def test_subpackage_apis():
    assert sorted(sp_attention.linear.__all__) == sorted([
        "lightning_attention", "IMPLS", "DEFAULT_IMPL", "LinearTuning", "recurrent_linear_attention",
        "chunked_linear_attention", "release_cuda_graphs"])
    assert sorted(sp_attention.comm.__all__) == sorted([
        "all_gather_flat", "reduce_scatter_flat", "all_gather_along", "reduce_scatter_along",
        "gather_along", "scatter_reduce_along", "pad_flat", "p2p_exchange", "RingComm",
        "AsyncReduceScatter", "check_collective_input", "all_to_all_flat"])
