"""Cross-rank loss share and gradient all-reduce (sp_train.reduce) on gloo."""
import pytest
import torch
import torch.distributed as dist

from sp_train.reduce import all_reduce_gradients, global_token_mean
from sp_attention.testing import run_distributed, seeded


def _worker(rank, world):
    torch.manual_seed(0)
    w = torch.nn.Parameter(seeded((5,), 1))
    b = torch.nn.Parameter(seeded((3,), 2, dtype=torch.float32))
    x = seeded((world, 4, 5), 3)                      # global batch of world × 4 tokens
    mask = (seeded((world, 4), 4) > -0.3)
    # single-process reference: mean over the real tokens of the whole batch
    ref_w, ref_b = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    tok = (x @ ref_w) + ref_b.double().sum()
    ref = (tok * mask).sum() / mask.sum()
    ref.backward()
    # this rank's tokens only
    share = global_token_mean((x[rank] @ w) + b.double().sum(), mask[rank], dist.group.WORLD)
    share.backward()
    all_reduce_gradients([w, b], dist.group.WORLD)
    total = share.detach().clone()
    dist.all_reduce(total)
    assert torch.allclose(total, ref.detach(), rtol=1e-12)
    assert torch.allclose(w.grad, ref_w.grad, rtol=1e-12)
    assert w.grad.dtype == torch.float64
    assert torch.allclose(b.grad, ref_b.grad, rtol=1e-6)
    return True


def test_share_and_gradients_match_single_process():
    assert all(run_distributed(_worker, 3))


def test_bad_input():
    with pytest.raises(ValueError, match="shape of token_loss"):
        global_token_mean(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="no real token"):
        global_token_mean(torch.ones(3), torch.zeros(3))
    with pytest.raises(TypeError, match="member"):
        global_token_mean(torch.ones(3), None, group=-100)
