"""``train.py --cuda-graphs``: every transformer layer's forward and backward replayed from CUDA
graphs, so the host issues one launch per layer and direction instead of the layer's ~150
kernels (Megatron's projections, norms and unfused RoPE, our CP op's local kernels and scans).

At CP = 4 a step of the 1B models lost 20–30 % to hosts that fell behind their GPUs (the
profile in ``sp_train/README.md``): this takes the layers' host work out of the step. It uses
torch's own ``torch.cuda.make_graphed_callables`` on each layer (all layers in one call, so
they share one memory pool and are captured in the order a step runs them):

- :class:`LayerGraphs` marks the decoder's layers when the model is built (the distributed
  optimizer's ``--overlap-param-gather`` then waits for a whole layer's parameters before it,
  since hooks inside a replayed layer never run) and captures them at the first forward, on
  the shapes that forward brings (every layer takes the same hidden states and RoPE angles);
  make_graphed_callables warms each layer up three times first (Triton's autotuning, NCCL's
  connections, torch.compile'd fusions), on random inputs whose results are thrown away.
- The parameter names, the checkpoints and the numbers do not change: a replay runs the same
  kernels on the same parameters (the CP op's own scan graphs run inside the layer's graph).
- Static shapes only: a call with other shapes, packed documents (``packed_seq_params``), an
  attention mask or an inference context raises (``--cuda-graphs`` refuses ``--packing
  documents`` and activation recompute up front).
- A graph holds its process groups' NCCL communicators, and NCCL cannot destroy a communicator
  that a live graph holds: :meth:`LayerGraphs.release` drops them (train.py does when its
  loop ends, also on an error, so before ``destroy_process_group``).

Memory: each layer keeps static input, output and gradient buffers in the graphs' one pool;
measured at CP 4 (1B, 32K) the peak was ~2 GiB *lower* than without graphs (hybrid 34.2 → 32.1
GB, softmax 32.5 → 30.4), the pool's blocks being planned once instead of cached per size.
"""
from __future__ import annotations

import gc
from typing import Optional

import torch

__all__ = ["LayerGraphs", "GRAPHED"]

GRAPHED = "_sp_cuda_graphed"    # set on a layer whose forward replays a graph (see attach())


class _LayerCall(torch.nn.Module):
    """One layer as make_graphed_callables wants it: tensors in, a tensor out, its parameters
    those of the layer (its only child)."""

    def __init__(self, layer: torch.nn.Module, forward):
        super().__init__()
        self.layer = layer
        self._forward = forward              # the layer's own forward (bound, unreplaced)

    def forward(self, hidden: torch.Tensor, rope: Optional[torch.Tensor] = None):
        out = self._forward(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        return out[0] if isinstance(out, tuple) else out


class LayerGraphs:
    """Replays each layer of ``layers`` (the decoder's, e.g. ``model.decoder.layers``) from CUDA
    graphs captured at their first call (see the module docstring). ``warmup``: eager
    forward + backward passes per layer before the capture. ``make_graphed``: what captures
    (torch's ``make_graphed_callables``; the CPU tests pass one that returns the layers as
    they are, to check everything around the capture)."""

    def __init__(self, layers, *, warmup: int = 3, make_graphed=None):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("--cuda-graphs: the model has no decoder layers to capture")
        self.warmup = warmup
        self.make_graphed = make_graphed or torch.cuda.make_graphed_callables
        self.calls: Optional[list] = None    # the graphed _LayerCall of each layer, once made
        self.signature: Optional[tuple] = None
        self._own = []
        for i, layer in enumerate(self.layers):
            setattr(layer, GRAPHED, True)
            self._own.append(layer.forward)
            layer.forward = self._make_forward(i)

    def _make_forward(self, i: int):
        def forward(hidden_states=None, attention_mask=None, context=None, rotary_pos_emb=None,
                    packed_seq_params=None, inference_context=None, **rest):
            self._check(hidden_states, attention_mask, rotary_pos_emb, packed_seq_params,
                        inference_context, rest)
            if self.calls is None:
                self._capture(hidden_states, rotary_pos_emb)
            call = self.calls[i]
            out = call(hidden_states) if rotary_pos_emb is None else call(hidden_states,
                                                                          rotary_pos_emb)
            return out, context
        return forward

    @staticmethod
    def _describe(hidden, rope) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) if t is not None else None
                     for t in (hidden, rope))

    def _check(self, hidden, attention_mask, rope, packed, inference_context, rest) -> None:
        if packed is not None:
            raise ValueError("--cuda-graphs replays fixed shapes: packed documents "
                             "(packed_seq_params) cannot be replayed; drop --cuda-graphs or "
                             "train with --packing none")
        if attention_mask is not None or inference_context is not None:
            raise ValueError("--cuda-graphs captures causal training layers: an attention mask "
                             "or an inference context cannot be replayed")
        extra = {k: v for k, v in rest.items() if isinstance(v, torch.Tensor)}
        if extra:
            raise ValueError(f"--cuda-graphs: the layer was called with {sorted(extra)}, which "
                             "a captured layer does not take; drop --cuda-graphs")
        if hidden is None:
            raise ValueError("--cuda-graphs: the layer was called without hidden_states")
        sig = self._describe(hidden, rope)
        if self.signature is not None and sig != self.signature:
            raise ValueError(f"--cuda-graphs captured the layers for inputs {self.signature}; "
                             f"this call brings {sig} (every step must have the same micro-batch "
                             "size and sequence length)")

    def _capture(self, hidden: torch.Tensor, rope: Optional[torch.Tensor]) -> None:
        calls = tuple(_LayerCall(layer, own) for layer, own in zip(self.layers, self._own))
        for c in calls:
            c.train(self.layers[0].training)
        samples = []
        for _ in calls:
            h = torch.randn(hidden.shape, dtype=hidden.dtype, device=hidden.device) * 0.02
            samples.append((h.requires_grad_(),) if rope is None else
                           (h.requires_grad_(), rope.detach().clone()))
        # The capture runs on make_graphed_callables' own stream, which makes the parameters'
        # gradient accumulators there, and its graphs keep them: later steps accumulate (and
        # run the gradient reducer's hooks) on that stream, autograd ordering it after the
        # replayed backward with an event — correct, one event wait per parameter. Making the
        # accumulators on the default stream beforehand instead (autograd's advice) gave runs
        # that did not reach their first step (4 x H200, 2026-11-27; the default stream cannot
        # join a capture), so the warning about the mismatch is turned off, not the mismatch.
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        if hidden.is_cuda:
            torch.cuda.synchronize()
        graphed = self.make_graphed(calls, tuple(samples), num_warmup_iters=self.warmup,
                                    allow_unused_input=True)
        self.calls = list(graphed)
        self.signature = self._describe(hidden, rope)

    def own_grads(self) -> None:
        """Give every layer parameter's ``.grad`` its own memory. A replayed backward leaves
        its parameters' gradients in the graph's static buffers and autograd keeps them as
        ``.grad`` without a copy, so the next micro-batch's replay would overwrite what was
        accumulated: call this after each backward whose gradients are accumulated further
        (train.py does between micro-batches)."""
        if self.calls is None:
            return
        for layer in self.layers:
            for p in layer.parameters():
                if p.grad is not None:
                    p.grad = p.grad.clone()

    def release(self) -> None:
        """Give the layers their own forwards back and drop the graphs (captured again at the
        next call of a new :class:`LayerGraphs`)."""
        if self.calls is not None and torch.cuda.is_available():
            try:
                torch.cuda.synchronize()        # nothing of theirs still queued
            except RuntimeError:                # a CUDA error earlier: nothing left to protect
                pass
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
            if hasattr(layer, GRAPHED):
                delattr(layer, GRAPHED)
        self.calls = None
        self.signature = None
        self._own = []
        gc.collect()                            # the graphs go with their autograd functions

