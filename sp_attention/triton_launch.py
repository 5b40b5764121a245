"""Triton launches remembered per call signature: the host cost of a launch without Triton's
per-call Python.

``kernel[grid](*args, **kwargs)`` on a ``triton.autotune`` / ``triton.heuristics`` /
``triton.jit`` stack runs, per call, the autotuner's key (a ``str`` of every tensor's dtype),
each heuristic, the JIT's argument binding and specialization, its cache key and the launch
metadata: 50–400 µs of host per launch on the device VMs, several times the CUDA launch itself.
A linear layer's forward + backward makes ~6 such launches, so on an eager layer (the host
enqueues while the GPU runs) they are a large part of the step (``sp_attention/linear/README.md``,
"Where the host time goes").

:func:`launch` runs the first call of a *signature* through Triton as usual and remembers what
Triton resolved: the compiled kernel, the autotuner's chosen config and the heuristics' values.
Later calls with the same signature launch that compiled kernel directly with the new argument
values. The signature is everything Triton's choices can depend on, strictly: per tensor its
dtype, shape and whether its address is 16-byte aligned (Triton specializes pointers on that);
every other argument by type and exact value (Triton specializes ints on divisibility by 16 and
on 1, heuristics may read any value); the current device. So a remembered launch runs the very
kernel binary, config and constants Triton's own path would choose — the same bits (the GPU
tests compare the two bit for bit). Not remembered (every call through Triton): stacks whose
chosen config has a ``pre_hook``, arguments that cannot be keyed (unhashable), Triton's CPU
interpreter (``TRITON_INTERPRET=1``) and while a Triton launch hook is installed (profilers
such as proton read the launch metadata Triton builds). Triton's check that the module globals a
kernel reads have not changed since it was compiled runs on a signature's first call only (the
library's kernels read constants).

:func:`plain_launches` turns the memory off for a block (A/B runs, tests);
``SP_ATTENTION_PLAIN_LAUNCHES=1`` in the environment turns it off for a whole process (an A/B of
a program such as train.py).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import warnings
from typing import Any, Iterator, Optional

import torch

from .caches import LRU

__all__ = ["launch", "device_guard", "plain_launches", "remembered", "forget", "signature_key",
           "SlowLaunchWarning", "SLOW_FIRST_LAUNCH_S", "disk_cached"]

# A first launch that holds the host this long (compiling, autotuning) is reported once: on a
# fresh machine it is what a slow first step is made of, and the key names what to ship.
SLOW_FIRST_LAUNCH_S = 5.0


class SlowLaunchWarning(UserWarning):
    """A kernel's first launch of a signature compiled or autotuned for longer than
    :data:`SLOW_FIRST_LAUNCH_S`; the message names the kernel, the time, and the autotune keys
    it tuned (keys without a result in Triton's cache, e.g. not among the shipped ones of
    ``sp_attention/linear/tuned/``)."""

_ENTRIES = LRU(4096)


def disk_cached() -> dict:
    """``triton.autotune`` keywords that keep a kernel's tuning results in Triton's on-disk
    cache, as fla's kernels do (``cache_results=True``; ``{}`` on a Triton without the
    option). Without them Triton reads and writes that cache only under
    ``TRITON_CACHE_AUTOTUNING=1``: every process autotuned our kernels again, and the results
    the package ships (``sp_attention/linear/tuned/``) were never read."""
    import inspect

    import triton
    return ({"cache_results": True}
            if "cache_results" in inspect.signature(triton.autotune).parameters else {})


def _on_by_environment() -> bool:
    """Remembered launches unless ``SP_ATTENTION_PLAIN_LAUNCHES=1``."""
    return os.environ.get("SP_ATTENTION_PLAIN_LAUNCHES", "0") != "1"


_state = {"on": _on_by_environment()}
_UNKEYED = object()      # a call whose arguments cannot be keyed: Triton's own path


def signature_key(args: tuple, kwargs: dict) -> Any:
    """The part of a launch's key its arguments give (see the module doc); ``_UNKEYED`` when
    an argument cannot be hashed. Pure: tested on CPU."""
    key = _key(args, kwargs)
    try:
        hash(key)
    except TypeError:
        return _UNKEYED
    return key


def _key(args: tuple, kwargs: dict) -> tuple:
    tensor = torch.Tensor
    return (tuple((a.dtype, a.shape, a.data_ptr() % 16 == 0) if isinstance(a, tensor)
                  else (type(a), a) for a in args),
            tuple((n, (a.dtype, a.shape, a.data_ptr() % 16 == 0) if isinstance(a, tensor)
                   else (type(a), a)) for n, a in kwargs.items()))


_NULL = contextlib.nullcontext()


def device_guard(where) -> contextlib.AbstractContextManager:
    """The context a launch on ``where`` (a tensor or a ``torch.device``) runs in: its CUDA
    device made current, or nothing to do (a shared null context) when it already is or
    ``where`` is on the CPU — the common case, without ``torch.cuda.device``'s per-call
    Python."""
    if isinstance(where, torch.Tensor):
        idx = where.get_device()
    else:
        idx = -1 if where.type != "cuda" else where.index
    if idx is None or idx < 0 or idx == torch.cuda.current_device():
        return _NULL
    return torch.cuda.device(idx)


class _Entry:
    """A compiled kernel and the full argument set (parameter order) its first call bound."""

    __slots__ = ("kernel", "template", "names", "keywords")

    def __init__(self, kernel, template: dict, names: tuple, keywords: tuple):
        # keywords: the call's keyword names that are kernel parameters (the others, such as
        # num_warps, are compile options: part of the key, baked into the binary)
        self.kernel, self.template, self.names, self.keywords = kernel, template, names, keywords

    def __call__(self, grid, args: tuple, kwargs: dict, stream: int) -> None:
        values = dict(self.template)
        values.update(zip(self.names, args))
        for name in self.keywords:
            values[name] = kwargs[name]
        g = grid(values) if callable(grid) else grid
        self.kernel[(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)](
            *values.values(), stream=stream)


def _chain(fn) -> tuple:
    """``(wrappers, jit)``: the ``triton.autotune`` / ``triton.heuristics`` wrappers from the
    outside in, and the ``triton.jit`` function under them (None if there is none)."""
    wrappers = []
    while fn is not None and not hasattr(fn, "add_pre_run_hook"):
        wrappers.append(fn)
        fn = getattr(fn, "fn", None)
    return wrappers, fn


def _clock() -> float:
    return time.perf_counter()


def _autotuners(wrappers: list) -> list:
    """The autotune wrappers (their ``cache``: key → config)."""
    return [w for w in wrappers if isinstance(getattr(w, "cache", None), dict)
            and hasattr(w, "configs")]


def _report_slow(jit, took: float, runs: int, tuned: list) -> None:
    name = getattr(getattr(jit, "fn", None), "__name__", None) or repr(jit)
    what = (f"autotuned ({runs} runs) for key {', '.join(map(str, tuned))}, which had no "
            "result in Triton's cache (the package ships results for its benchmarks' and 1B "
            "models' shapes; scripts/harvest_triton_cache.py adds a run's)"
            if tuned else "compiled")
    warnings.warn(f"sp_attention: the first launch of Triton kernel {name} held the host "
                  f"{took:.1f} s: {what}; later launches reuse it (Triton's cache)",
                  SlowLaunchWarning, stacklevel=4)


def _config_hooks(wrappers: list) -> bool:
    """Whether a wrapper runs a config ``pre_hook`` (run per call: not remembered)."""
    return any(getattr(getattr(w, "best_config", None), "pre_hook", None) is not None
               for w in wrappers)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: None or, from Triton 3.5, an empty
    ``HookChain`` (``knobs.runtime``'s default) is none."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=1)
def _runtime_knobs():
    from triton import knobs
    return knobs.runtime


def _launch_hooked() -> bool:
    runtime = _runtime_knobs()
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


def _first_call(fn, grid, args: tuple, kwargs: dict) -> Optional[_Entry]:
    """Launch through Triton and capture what its JIT function was finally called with (the
    last call: an autotuner's benchmark runs come first)."""
    wrappers, jit = _chain(fn)
    if jit is None:
        fn[grid](*args, **kwargs)
        return None
    seen: list = []
    runs = [0]
    me = threading.get_ident()

    def hook(*a, **kw):             # this thread's call only (autograd runs on its own thread)
        if threading.get_ident() == me:
            seen[:] = [(a, kw)]
            runs[0] += 1
    tuners = _autotuners(wrappers)
    known = [set(t.cache) for t in tuners]
    jit.add_pre_run_hook(hook)
    start = _clock()
    try:
        kernel = fn[grid](*args, **kwargs)
    finally:
        jit.pre_run_hooks.remove(hook)
    took = _clock() - start
    if took >= SLOW_FIRST_LAUNCH_S:
        _report_slow(jit, took, runs[0], [k for t, old in zip(tuners, known)
                                          for k in t.cache if k not in old])
    if not seen or kernel is None or not hasattr(kernel, "function") \
            or _config_hooks(wrappers):
        return None
    a, kw = seen[0]
    names = tuple(jit.arg_names)
    params = jit.signature.parameters
    keywords = tuple(k for k in kwargs if k in params)
    given = set(names[:len(args)]) | set(keywords)
    template = {}
    caller = dict(zip(names, args), **kwargs)
    for i, name in enumerate(names):
        if name in given:
            # the caller's value, per call (no tensor of this call is held) — unless a
            # heuristic replaced it, which a later call's value must not undo
            seen_value, value = (a[i] if i < len(a) else kw.get(name)), caller[name]
            if seen_value is not value and (isinstance(seen_value, torch.Tensor)
                                            or isinstance(value, torch.Tensor)
                                            or seen_value != value):
                return None
            template[name] = None
        elif i < len(a):
            template[name] = a[i]
        elif name in kw:
            template[name] = kw[name]
        elif params[name].default is not params[name].empty:
            template[name] = params[name].default
        else:                       # Triton would have refused the call: do not remember it
            return None
    return _Entry(kernel, template, names, keywords)


def launch(fn, grid, /, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``: through Triton the first time per call signature, then
    the remembered compiled kernel (module doc). ``fn``: a ``triton.jit`` function, possibly
    under ``triton.autotune`` / ``triton.heuristics``; ``grid``: a tuple, or a callable of the
    bound arguments (constexprs included) as Triton takes it."""
    if not _state["on"] or not torch.cuda.is_available() or _interpreted():
        fn[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = (id(fn), device, _key(args, kwargs))
    try:
        entry = _ENTRIES.lookup(key)
    except TypeError:                   # an argument that cannot be keyed
        fn[grid](*args, **kwargs)
        return
    if entry is None or _launch_hooked():
        made = _first_call(fn, grid, args, kwargs)
        if made is not None and not _launch_hooked():
            _ENTRIES.put(key, (fn, made))      # fn held: its id stays unique while remembered
        return
    entry[1](grid, args, kwargs, torch._C._cuda_getCurrentRawStream(device))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def remembered() -> int:
    """How many launch signatures are remembered (tests, diagnostics)."""
    return len(_ENTRIES)


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Every :func:`launch` in the block goes through Triton's own path (nothing remembered
    is used or added): the A/B baseline, and the reference the GPU tests compare against."""
    before = _state["on"]
    _state["on"] = False
    try:
        yield
    finally:
        _state["on"] = before


def forget() -> None:
    """Drop every remembered launch (tests)."""
    _ENTRIES.clear()

