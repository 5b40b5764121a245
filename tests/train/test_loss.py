"""The chunked linear + cross entropy (sp_train/loss.py) against plain
``F.cross_entropy`` on the full logits: loss, per-token losses, and the gradients of the hidden
states and the output weight.

- fp64, one rank: 1e-10 for every chunk size (1 token, uneven, one chunk, bigger than T), with
  ignored labels, and with a scaled upstream gradient.
- One gloo spawn of 2 ranks (TP = 2, vocabulary split): fp64 torch path to 1e-10 at every
  rank (dW = the rank's slice of the full dW, dh summed over TP), and the Triton row kernels in
  Triton's CPU interpreter (fp32, TP = 1 and TP = 2) to 1e-5.
- Bad input raises with the fix.
"""
import os

import pytest
import torch

from sp_attention.testing import run_distributed

T, H, V = 37, 16, 54


def _data(dtype=torch.float64, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(vocab, H, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, (T,), generator=g)
    labels[::5] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, scale):
    from sp_train.loss import linear_cross_entropy_ref
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    loss = linear_cross_entropy_ref(h, w, labels)
    (loss * scale).backward()
    tok = torch.nn.functional.cross_entropy(h.detach() @ w.detach().t(), labels,
                                            reduction="none")
    return loss.detach(), tok, h.grad, w.grad


def _ours(hidden, weight, labels, scale, **kw):
    from sp_train.loss import linear_cross_entropy
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss, tok = linear_cross_entropy(h, w, labels, **kw)
    (loss * scale).backward()
    return loss.detach(), tok, h.grad, w.grad


def _err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [1, 5, 8, T, 100, None])
def test_fp64_matches_full_logits(chunk):
    hidden, weight, labels = _data()
    ref = _reference(hidden, weight, labels, 0.37)
    got = _ours(hidden, weight, labels, 0.37, chunk_tokens=chunk)
    for g, r in zip(got, ref):
        assert _err(g, r) < 1e-10, (chunk, _err(g, r))
    assert bool((got[1][labels == -100] == 0).all())


def test_no_grad_and_frozen_weight():
    """Without grad mode nothing but the loss is computed; a frozen weight gets no grad."""
    from sp_train.loss import linear_cross_entropy
    hidden, weight, labels = _data()
    ref = _reference(hidden, weight, labels, 1.0)
    import sp_train.loss as loss_mod
    calls = []
    real_mm = loss_mod._add_weight_grad
    loss_mod._add_weight_grad = lambda *a: calls.append(1) or real_mm(*a)
    try:
        with torch.no_grad():       # the inputs require grad, but nothing records the call
            loss, _ = linear_cross_entropy(hidden.requires_grad_(True),
                                           weight.requires_grad_(True), labels, chunk_tokens=8)
    finally:
        loss_mod._add_weight_grad = real_mm
    hidden.requires_grad_(False)
    weight.requires_grad_(False)
    assert _err(loss, ref[0]) < 1e-10 and not calls      # no gradient work under no_grad
    h = hidden.clone().requires_grad_(True)
    loss, _ = linear_cross_entropy(h, weight, labels, chunk_tokens=8)
    loss.backward()
    assert _err(h.grad, ref[2]) < 1e-10 and weight.grad is None


def test_bad_input_names_the_fix():
    from sp_train.loss import linear_cross_entropy
    hidden, weight, labels = _data()
    bad = labels.clone()
    bad[3] = V
    with pytest.raises(ValueError, match="--vocab-size"):
        linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(ValueError, match=r"\[T, h\]"):
        linear_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="dtypes differ"):
        linear_cross_entropy(hidden.float(), weight, labels)
    with pytest.raises(ValueError, match="one label per hidden row"):
        linear_cross_entropy(hidden, weight, labels[:-1])


def _tp_worker(rank, world):
    """TP = world over the vocabulary: torch path in fp64, then the Triton kernels
    interpreted (the interpreter is chosen before the kernels module is imported)."""
    import torch.distributed as dist
    os.environ["TRITON_INTERPRET"] = "1"
    import sp_train.loss_kernels as kernels
    kernels.BLOCK_V = 8                      # several column blocks per row at V/TP = 27
    group = dist.new_group(list(range(world)))
    out = {}
    per = V // world
    rows = slice(rank * per, (rank + 1) * per)
    for name, dtype, triton_on, tol in (("torch", torch.float64, False, 1e-10),
                                        ("triton", torch.float32, True, 1e-5)):
        hidden, weight, labels = _data(dtype, seed=3)
        ref = _reference(hidden, weight, labels, 0.5)
        for tp, grp in ((1, None), (world, group)):
            w = weight if tp == 1 else weight[rows]
            got = _ours(hidden, w, labels, 0.5, tp_group=grp, chunk_tokens=7,
                        use_triton=triton_on)
            ref_w = ref[3] if tp == 1 else ref[3][rows]
            errs = [_err(got[0], ref[0]), _err(got[1], ref[1]), _err(got[2], ref[2]),
                    _err(got[3], ref_w)]
            out[name, tp] = (max(errs), tol)
    return out


def test_vocab_parallel_tp2_and_triton_kernels_interpreted():
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    results = run_distributed(_tp_worker, 2, timeout=300)
    for rank, res in enumerate(results):
        for key, (err, tol) in res.items():
            assert err < tol, (rank, key, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("vocab,chunk", [(128256, None), (50304, 1000), (1000, 7)])
def test_triton_kernels_on_gpu_bf16(vocab, chunk):
    """bf16 on the GPU: the Triton row kernels vs the torch path (fp32 math) vs full logits in
    fp32: loss within 1e-3 relative, gradients within 1e-2 relative RMS; ignored rows zero."""
    from sp_train.loss import linear_cross_entropy, linear_cross_entropy_ref
    torch.manual_seed(0)
    n, h = 4099, 512
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(vocab, h, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::5] = -100
    got = {}
    for name, kw in (("triton", dict(use_triton=True)), ("torch", dict(use_triton=False))):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, tok = linear_cross_entropy(hh, ww, labels, chunk_tokens=chunk, **kw)
        loss.backward()
        got[name] = (loss.detach(), hh.grad, ww.grad)
        assert bool((tok[labels == -100] == 0).all())
    hh = hidden.float().requires_grad_(True)
    ww = weight.float().requires_grad_(True)
    ref = linear_cross_entropy_ref(hh, ww, labels)
    ref.backward()
    for name, (loss, dh, dw) in got.items():
        assert _err(loss, ref.detach()) < 1e-3, (name, float(loss), float(ref))
        for g, r in ((dh, hh.grad), (dw, ww.grad)):
            rms = float((g.float() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt())
            assert rms < 1e-2, (name, rms)


def _scaled_worker():
    os.environ["TRITON_INTERPRET"] = "1"
    from sp_train.loss_kernels import scaled
    g = torch.Generator().manual_seed(5)
    out = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(5003, generator=g) * 3).to(dtype)
        s = torch.tensor(1 / 3072.0 / 7, dtype=torch.float32)
        got, want = scaled(x, s), x * float(s)
        if dtype == torch.bfloat16:     # the interpreter rounds fp32 -> bf16 toward zero
            ulp = want.float().abs() * 2.0 ** -7
            out[str(dtype)] = bool(((got.float() - want.float()).abs() <= ulp).all())
        else:
            out[str(dtype)] = bool(torch.equal(got, want))
    return out


def test_gradient_scale_read_on_the_device_is_exact():
    """The loss's backward scales by the incoming gradient without a host sync
    (``loss_kernels.scaled``): what ``x * float(s)`` gives — bit for bit in fp16 and fp32 here,
    within the last bf16 bit (Triton's CPU interpreter truncates to bf16 where the GPU rounds;
    ``-m gpu`` below checks bf16 bit for bit on a GPU). A separate process: the interpreter is
    chosen when Triton's kernels are imported."""
    pytest.importorskip("triton", reason="triton is in the `test` extra; install it to run this")
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_scaled_worker)
    assert got and all(got.values()), got


def test_train_checks_labels_on_the_host():
    """train.py's batches are checked before they reach the device, so its loss skips the
    device-side check (a host sync mid-step); a bad id is refused with the fix named."""
    from sp_train.data import IGNORE, check_labels
    check_labels(torch.tensor([[0, 5, IGNORE, 9]]), 10)
    with pytest.raises(ValueError, match=r"\[0, 10\).*e\.g\. 10"):
        check_labels(torch.tensor([[0, 10, IGNORE]]), 10)
    with pytest.raises(ValueError, match="e.g. -3"):
        check_labels(torch.tensor([[-3]]), 10)
    from sp_train.loss import linear_cross_entropy
    hidden, weight = torch.randn(3, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 6, 1]))
    linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 1]), check_labels=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
def test_gpu_backward_scale_matches_the_host_scale():
    """On a GPU the loss's backward reads the incoming gradient on the device: bit for bit what
    the scale read on the host gives (``x * float(s)``), and the loss's gradients through it
    equal those of the torch path's host scale."""
    from sp_train.loss_kernels import scaled
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1 << 20, device="cuda").to(dtype)
        s = torch.tensor(1 / 32768.0 / 3, device="cuda")
        assert torch.equal(scaled(x, s), x * float(s))
    from sp_train.loss import linear_cross_entropy
    hidden = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(1000, 256, device="cuda")).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (4096,), device="cuda")
    grads = []
    for scale in (1.0, 1 / 3000.0):         # the incoming gradient: 1, then a mean's 1/n
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = linear_cross_entropy(hh, ww, labels, check_labels=False)
        (loss * scale).backward()
        grads.append((hh.grad, ww.grad))
    (dh1, dw1), (dh, dw) = grads
    dh2, dw2 = dh1 * (1 / 3000.0), dw1 * (1 / 3000.0)      # the scale read on the host
    assert torch.equal(dh, dh2) and torch.equal(dw, dw2)
