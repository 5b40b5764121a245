"""The remembered Triton launches (:mod:`sp_attention.triton_launch`).

On CPU: the call signature (what must change the key) and how a first call's capture becomes
a launch of the compiled kernel with a later call's values — through stand-ins that follow
Triton's protocol (``fn[grid](...)`` returns the compiled kernel; the JIT function's pre-run
hooks see the arguments it is finally called with, heuristics' and config values included).
On a GPU (``-m gpu``): real kernels — fla's chunk-state kernels under their autotune and
heuristics, our output kernel — give the same bits remembered as through Triton's own path,
also with a misaligned input, which must not reuse the aligned binary.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from sp_attention import triton_launch as tl_launch
from sp_attention.triton_launch import plain_launches, signature_key


def test_signature_key_separates_what_triton_specializes_on():
    x = torch.zeros(8, 4)
    base = signature_key((x, 16), {"BLOCK": 32})
    assert signature_key((x.clone(), 16), {"BLOCK": 32}) == base        # values do not count
    assert signature_key((x.double(), 16), {"BLOCK": 32}) != base       # dtype
    assert signature_key((torch.zeros(4, 8), 16), {"BLOCK": 32}) != base  # shape
    assert signature_key((torch.zeros(33)[1:].view(8, 4), 16), {"BLOCK": 32}) != base  # align
    assert signature_key((x, 17), {"BLOCK": 32}) != base                # int values
    assert signature_key((x, 16), {"BLOCK": 64}) != base
    assert signature_key((x, 16), {"BLOCK": 32, "num_warps": 4}) != base  # options
    assert signature_key((x, True), {"BLOCK": 32}) != signature_key((x, 1), {"BLOCK": 32})
    assert signature_key((x, None), {}) != signature_key((x, 0), {})
    assert signature_key((x, [1, 2]), {}) is tl_launch._UNKEYED          # unhashable


def test_a_launch_on_the_cpu_or_the_current_device_needs_no_guard():
    assert tl_launch.device_guard(torch.zeros(1)) is tl_launch._NULL
    assert tl_launch.device_guard(torch.device("cpu")) is tl_launch._NULL
    assert tl_launch.device_guard(torch.device("cuda")) is tl_launch._NULL   # the current one


def test_the_environment_can_turn_the_memory_off_for_a_process(monkeypatch):
    monkeypatch.delenv("SP_ATTENTION_PLAIN_LAUNCHES", raising=False)
    assert tl_launch._on_by_environment()
    monkeypatch.setenv("SP_ATTENTION_PLAIN_LAUNCHES", "1")
    assert not tl_launch._on_by_environment()


def test_an_empty_hook_chain_is_no_launch_hook():
    class Chain:                    # Triton >= 3.5's knobs.runtime.launch_enter_hook default
        def __init__(self, calls):
            self.calls = calls
    assert not tl_launch._hooked(None) and not tl_launch._hooked(Chain([]))
    assert tl_launch._hooked(Chain([print])) and tl_launch._hooked(print)


class _Compiled:
    """A compiled kernel stand-in: ``kernel[grid](*args, stream=)`` records the launch."""

    function = object()

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, stream=None):
            self.launches.append((grid, args, stream))
        return run


class _Jit:
    """``triton.jit``'s protocol: pre-run hooks see the final arguments; returns the kernel."""

    def __init__(self, py):
        self.fn = py
        self.signature = inspect.signature(py)
        self.arg_names = list(self.signature.parameters)
        self.pre_run_hooks = []
        self.compiled = _Compiled()

    def add_pre_run_hook(self, hook):
        self.pre_run_hooks.append(hook)

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = False                       # Triton adds its options here
        for hook in self.pre_run_hooks:
            hook(*args, **kwargs)
        self.compiled[grid(dict(zip(self.arg_names, args), **kwargs)) if callable(grid)
                      else grid](*args)
        return self.compiled

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(*a, grid=grid, warmup=False, **kw)


class _Heuristics:
    """``triton.heuristics``: values computed from the arguments, added as keywords."""

    def __init__(self, fn, values):
        self.fn, self.values, self.arg_names = fn, values, fn.arg_names

    def run(self, *args, **kwargs):
        for name, rule in self.values.items():
            kwargs[name] = rule({**dict(zip(self.arg_names, args)), **kwargs})
        return self.fn.run(*args, **kwargs)

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(*a, grid=grid, warmup=False, **kw)


def _kernel(x, out, n, scale, BLOCK=16, EVEN=False):
    pass


def test_a_first_call_becomes_a_launch_of_its_kernel_with_later_values():
    jit = _Jit(_kernel)
    stack = _Heuristics(jit, {"EVEN": lambda a: a["n"] % 16 == 0})
    x, out = torch.zeros(4), torch.zeros(4)
    entry = tl_launch._first_call(stack, (1,), (x, out), dict(n=32, scale=0.5, num_warps=4))
    assert entry is not None and not jit.pre_run_hooks          # the capture hook is gone
    # no tensor of the first call is held; the heuristic's value and the default are
    assert all(not isinstance(v, torch.Tensor) for v in entry.template.values())
    assert entry.template["EVEN"] is True and entry.template["BLOCK"] == 16
    assert entry.keywords == ("n", "scale")                     # num_warps: an option
    x2, out2 = torch.ones(4), torch.ones(4)
    entry(lambda meta: (meta["n"] // meta["BLOCK"],), (x2, out2), dict(n=32, scale=0.25,
                                                                      num_warps=4), stream=7)
    grid, args, stream = jit.compiled.launches[-1]
    assert grid == (2, 1, 1) and stream == 7
    assert args[0] is x2 and args[1] is out2 and args[2:] == (32, 0.25, 16, True)


class _Autotuner:
    """``triton.autotune``'s protocol: a ``cache`` of key → config, benchmark runs on a miss."""

    def __init__(self, fn, key, n_configs):
        self.fn, self.arg_names, self.key = fn, fn.arg_names, key
        self.configs, self.cache = [None] * n_configs, {}

    def run(self, *args, **kwargs):
        k = tuple(dict(zip(self.arg_names, args), **kwargs)[name] for name in self.key)
        if k not in self.cache:
            for _ in self.configs:                       # the benchmark runs
                self.fn.run(*args, **kwargs)
            self.cache[k] = "best"
        return self.fn.run(*args, **kwargs)

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(*a, grid=grid, warmup=False, **kw)


def test_a_slow_first_launch_names_the_kernel_and_the_key_it_tuned(monkeypatch):
    jit = _Jit(_kernel)
    tuner = _Autotuner(jit, ["n"], n_configs=3)
    ticks = iter([0.0, 42.0, 100.0, 100.5])                # 42 s, then 0.5 s
    monkeypatch.setattr(tl_launch, "_clock", lambda: next(ticks))
    x = torch.zeros(2)
    with pytest.warns(tl_launch.SlowLaunchWarning, match=r"_kernel held the host 42\.0 s: "
                      r"autotuned \(4 runs\) for key \(8,\)"):
        assert tl_launch._first_call(tuner, (1,), (x, x, 8, 1.0), {}) is not None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # a quick first launch says nothing
        tl_launch._first_call(tuner, (1,), (x, x, 16, 1.0), {})


def test_a_call_a_heuristic_rewrites_is_not_remembered():
    jit = _Jit(_kernel)
    stack = _Heuristics(jit, {"BLOCK": lambda a: 64})          # overrides the caller's BLOCK
    entry = tl_launch._first_call(stack, (1,), (torch.zeros(2), torch.zeros(2)),
                                  dict(n=8, scale=1.0, BLOCK=16))
    assert entry is None
    stack = _Heuristics(jit, {"out": lambda a: 0})             # a tensor replaced by an int
    assert tl_launch._first_call(stack, (1,), (torch.zeros(2),),
                                 dict(out=torch.zeros(2), n=8, scale=1.0)) is None


def test_launch_goes_through_triton_where_nothing_can_be_remembered(monkeypatch):
    jit = _Jit(_kernel)
    before = tl_launch.remembered()
    monkeypatch.setenv("TRITON_INTERPRET", "1")                 # the CPU interpreter
    tl_launch.launch(jit, (3,), torch.zeros(2), torch.zeros(2), 8, 1.0)
    monkeypatch.delenv("TRITON_INTERPRET")
    with plain_launches():                                      # an A/B baseline
        tl_launch.launch(jit, (3,), torch.zeros(2), torch.zeros(2), 8, 1.0)
    assert [g for g, _, _ in jit.compiled.launches] == [(3,), (3,)]
    assert tl_launch.remembered() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_remembered_launches_give_tritons_bits_gpu():
    """fla's chunk-state kernels (autotune + heuristics, launched by
    :mod:`sp_attention.linear.fla_states` for fixed-length rows now: fla's wrapper's bits) and
    our output kernel: through Triton's path, then first and remembered calls, bit for bit; a
    misaligned input gets its own entry and the right result."""
    import math

    from sp_attention.linear import fla_states
    from sp_attention.linear.kernels import output_from_states

    torch.manual_seed(0)
    B, T, H, K, V = 2, 4096, 16, 128, 128      # the shapes of the shipped autotune results
    dev = "cuda"
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    gg = (-torch.linspace(0.01, 1.0, H, device=dev) / math.log(2)).float()
    S = torch.randn(B, H, K, V, device=dev)

    def step(q, k, v):
        h, ht = fla_states.chunk_fwd_h(k, v, g_gamma=gg, output_final_state=True,
                                       chunk_size=64)
        o = output_from_states(q, k, v, h, S, gg, 0.125)
        dh, _ = fla_states.chunk_bwd_dh(q, k, v, o, None, ht, 0.125, g_gamma=gg,
                                        chunk_size=64)
        return h, ht, o, dh

    with plain_launches():
        ref = step(q, k, v)
    from fla.ops.common import chunk_h              # fla's own wrapper, fixed-length rows
    fla_h, fla_ht = inspect.unwrap(chunk_h.chunk_fwd_h)(k, v, g_gamma=gg,
                                                         output_final_state=True, chunk_size=64)
    assert torch.equal(ref[0], fla_h) and torch.equal(ref[1], fla_ht), "not fla's chunk_fwd_h"
    tl_launch.forget()
    first = step(q, k, v)
    n = tl_launch.remembered()
    assert n >= 3
    again = step(q, k, v)
    assert tl_launch.remembered() == n
    buf = torch.empty(q.numel() + 1, device=dev, dtype=q.dtype)
    q_off = buf[1:].view_as(q)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 != 0
    off = step(q_off, k, v)
    assert tl_launch.remembered() > n
    for name, r, a, b, c in zip(("h", "ht", "o", "dh"), ref, first, again, off):
        for what, t in (("first", a), ("remembered", b), ("misaligned", c)):
            assert torch.equal(t, r), f"{name} {what}: not Triton's bits"


def test_our_autotuners_keep_results_on_disk():
    """Every autotuned kernel of the package reads and writes Triton's on-disk cache (where the
    shipped results are installed) without ``TRITON_CACHE_AUTOTUNING=1``, as fla's do."""
    pytest.importorskip("triton")
    from sp_attention.linear import dqk_kernel, dv_kernel, kernels
    from sp_attention.triton_launch import disk_cached
    assert disk_cached() == {"cache_results": True}
    tuners = [dv_kernel._dv_tuned, dqk_kernel._dqkdg_tuned, kernels._output_from_states_tuned,
              kernels._entering_state_tuned, kernels._decayed_state_sum_tuned]
    assert all(t.cache_results for t in tuners)
