"""Shard / unshard round trips, positions, labels and padding (no processes needed)."""
import pytest
import torch

from sp_attention import (SPContext, pad_for_layout, pad_to_multiple, shard_position_ids,
                          shard_sequence, shift_labels, unshard_sequence)


def _ctx(r, P, layout):
    # Pure sharding needs only rank arithmetic; a fake group object is never touched.
    return SPContext(object() if P > 1 else None, r, P, tuple(range(P)), layout)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_round_trip_and_positions(P, layout):
    T = 2 * P * 3
    x = torch.arange(2 * T * 5).reshape(2, T, 5)
    shards = [shard_sequence(x, _ctx(r, P, layout), dim=1) for r in range(P)]
    assert torch.equal(unshard_sequence(shards, layout, dim=1), x)
    pos = [shard_position_ids(T, _ctx(r, P, layout)) for r in range(P)]
    for r in range(P):
        # positions are the global token index of each local token
        assert torch.equal(shards[r][0, :, 0] // 5, pos[r])
    if layout == "zigzag" and P > 1:
        c = T // (2 * P)
        assert pos[0][:c].tolist() == list(range(c))
        assert pos[0][c:].tolist() == list(range(T - c, T))


def test_shift_labels_before_sharding():
    labels = torch.arange(8).unsqueeze(0)
    assert shift_labels(labels).tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    ctx = _ctx(0, 2, "zigzag")
    # rank 0's first chunk [0, 1] keeps targets [1, 2]: the target at a chunk edge is right.
    assert shard_sequence(shift_labels(labels), ctx, dim=1).tolist() == [[1, 2, 7, -100]]


def test_padding_uneven_lengths():
    x = torch.ones(2, 13, 3)
    padded, valid = pad_for_layout(x, _ctx(1, 3, "zigzag"), dim=1, value=-1)
    assert padded.shape == (2, 18, 3) and valid.sum() == 13 and not valid[13:].any()
    assert (padded[:, 13:] == -1).all()
    same, valid = pad_to_multiple(x, 13, dim=1)
    assert same is x and valid.all()
    with pytest.raises(ValueError, match="multiple"):
        pad_to_multiple(x, 0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="pad it to a multiple of 6"):
        shard_sequence(torch.zeros(1, 10), _ctx(0, 3, "zigzag"))
    with pytest.raises(TypeError, match="SPContext"):
        shard_sequence(torch.zeros(1, 10), "not a ctx")
    with pytest.raises(ValueError, match="shape"):
        unshard_sequence([torch.zeros(1, 2), torch.zeros(1, 4)], "contiguous")
    with pytest.raises(ValueError, match="positive"):
        SPContext(None, 0, 0)
    with pytest.raises(ValueError, match="process group"):
        SPContext(None, 0, 2)
    with pytest.raises(ValueError, match="unknown layout"):
        SPContext(None, 0, 1, layout="ring")
