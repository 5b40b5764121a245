"""HF models under ``torch.autocast`` (what HF Trainer's ``bf16=True`` and the example's GPU path
do): HF's RoPE hands q and k to attention in fp32 and v in bf16, and the library's ops follow
SDPA's rule (run in the autocast dtype). At CP = 2 and 3 on CPU/gloo the prepared Llama,
linear and hybrid models give the unpatched model's loss and gradients under the same autocast,
within bf16 noise. One spawn per world size."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from models.hf import (causal_lm_loss, global_loss_value, prepare_cp_batch,  # noqa: E402
                       prepare_model_for_cp)
from sp_train.reduce import all_reduce_gradients  # noqa: E402
from sp_attention.testing import rel_rms, run_distributed  # noqa: E402

from test_hf_cp import _cases, _models  # noqa: E402

# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per operation); CP changes the
# order of the sums (ring merges, scans, gradient reductions), so two bf16 runs differ by a
# few of those roundings, and the gradients of a 2-layer model by up to ~1e-2 relative.
LOSS_RTOL, GRAD_RTOL = 1e-2, 2e-2


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _reference(model, ids):
    model = copy.deepcopy(model)
    with _autocast():
        loss = model(ids, labels=ids.clone()).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp(model, ids, group):
    model = copy.deepcopy(model)
    handle = prepare_model_for_cp(model, group)
    batch = prepare_cp_batch(ids, handle.ctx)
    with _autocast():
        logits = model(**batch.model_inputs()).logits
    share = causal_lm_loss(logits, batch.labels, group)
    share.backward()
    all_reduce_gradients(model.parameters(), group)
    return global_loss_value(share, group), {n: p.grad for n, p in model.named_parameters()}


def check_autocast(rank, world):
    group = dist.new_group(list(range(world)))
    ids, _ = _cases()["plain"]
    worst = {}
    for kind, model in _models().items():
        ref_loss, ref_grads = _reference(model, ids)
        loss, grads = _cp(model, ids, group)
        err = abs(loss - ref_loss) / abs(ref_loss)
        assert err <= LOSS_RTOL, f"P={world} {kind}: loss {loss} vs {ref_loss} (rel {err:.2e})"
        for name, g in ref_grads.items():
            assert grads[name].dtype == torch.float32, (kind, name, grads[name].dtype)
            e = rel_rms(grads[name], g)
            assert e <= GRAD_RTOL, f"P={world} {kind}: grad {name} rel RMS {e:.2e}"
            worst[kind] = max(worst.get(kind, 0.0), e)
    return worst


@pytest.mark.parametrize("world", [2, 3])
def test_cp_under_autocast_equals_unpatched_model_under_autocast(world):
    run_distributed(check_autocast, world, timeout=300)
