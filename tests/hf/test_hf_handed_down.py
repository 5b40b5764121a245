"""HF's prepare_model_for_cp takes the options both CLIs build (one SPOptions, one name for the
scan down to the op), and a packed batch's plan travels with the batch to every attention
call. One process (CP = 1)."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import models.hf.attention as hf_attention  # noqa: E402
import models.hf.data as hf_data  # noqa: E402
from megatron_patches.args import add_arguments  # noqa: E402
from megatron_patches.options import SPOptions  # noqa: E402
from models.hf import (LinearLlamaConfig, LinearLlamaForCausalLM, prepare_cp_batch,  # noqa: E402
                       prepare_model_for_cp)
from tests.plan_counting import count_plan_calls  # noqa: E402


def _tiny(cls_config=LlamaConfig, **extra):
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return cls_config(**dict(shape, **extra))


def _hybrid(kinds=("linear", "softmax")):
    torch.manual_seed(0)
    return LinearLlamaForCausalLM(_tiny(LinearLlamaConfig, layer_kinds=list(kinds),
                                        num_hidden_layers=len(kinds)))


def test_command_line_options_reach_the_op(monkeypatch):
    ns = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--sp-model-kind", "hybrid", "--context-parallel-impl", "blelloch",
         "--softmax-cp-preset", "ring_ag"])
    options = SPOptions.from_flags(ns, num_layers=2)
    seen = []
    op = hf_attention.lightning_attention
    monkeypatch.setattr(hf_attention, "lightning_attention",
                        lambda *a, impl=None, **kw: seen.append(impl) or op(*a, impl=impl, **kw))
    model = _hybrid(options.layer_kinds)
    handle = prepare_model_for_cp(model, None, options=options)
    assert (handle.context_parallel_impl, handle.schedule) == ("blelloch",
                                                               options.softmax_schedule)
    assert handle.options.num_query_groups == 2          # the model's heads, its rules run
    model(torch.randint(0, 64, (1, 8)), position_ids=torch.arange(8)[None])
    assert seen == ["blelloch"]
    with pytest.raises(ValueError, match="describe the layers LS but the model's are SS"):
        prepare_model_for_cp(LlamaForCausalLM(_tiny()), None, options=options)
    with pytest.raises(ValueError, match="--context-parallel-impl blelloch does not fit"):
        prepare_model_for_cp(LlamaForCausalLM(_tiny()), None, context_parallel_impl="blelloch")
    with pytest.raises(TypeError, match="not both"):
        prepare_model_for_cp(_hybrid(), None, options=options, context_parallel_impl="ring")
    with pytest.warns(DeprecationWarning, match="linear_impl= is now context_parallel_impl="):
        old = prepare_model_for_cp(_hybrid(), None, linear_impl="ring")   # for one release
    assert old.context_parallel_impl == "ring"
    with pytest.warns(DeprecationWarning, match="context_parallel_impl"):
        assert old.linear_impl == "ring"


def test_the_packing_plan_travels_with_the_batch(monkeypatch):
    """prepare_cp_batch plans the row once; every layer's attention takes that plan from the
    forward kwargs. A batch with boundaries only (built elsewhere) is planned from them."""
    calls = count_plan_calls(monkeypatch, hf_data)
    model = _hybrid(("linear", "softmax", "gated", "softmax"))
    handle = prepare_model_for_cp(model, None)
    ids = torch.randint(0, 64, (1, 24))
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    batch = prepare_cp_batch(ids, handle.ctx, position_ids=positions)
    inputs = batch.model_inputs()
    assert inputs[hf_attention.PLAN_KWARG] is batch.plan and calls["plan"] == 1
    with_plan = model(**inputs).logits
    assert calls == {"plan": 1, "lookup": 0}                 # one per batch, none per layer
    del inputs[hf_attention.PLAN_KWARG]
    assert torch.equal(model(**inputs).logits, with_plan)
    assert calls["lookup"] == 4                             # the tensor-keyed cache, per layer


def test_linear_op_graphs_reach_the_op(monkeypatch):
    """``--linear-op-graphs`` (``SPOptions.linear_tuning``) reaches each linear and gated
    layer's op call as its LinearTuning; the gated layer keeps its gates unchecked (≤ 0 by
    construction). CPU tensors run eagerly whatever the tuning says."""
    ns = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "LGS", "--linear-op-graphs"])
    options = SPOptions.from_flags(ns, num_layers=3)
    seen = []
    op = hf_attention.lightning_attention
    monkeypatch.setattr(hf_attention, "lightning_attention",
                        lambda *a, tuning=None, **kw: seen.append(tuning) or op(*a, tuning=tuning,
                                                                                **kw))
    model = _hybrid(options.layer_kinds)
    prepare_model_for_cp(model, None, options=options)
    model(torch.randint(0, 64, (1, 8)), position_ids=torch.arange(8)[None])
    assert [(t.op_graphs, t.check_gate_values) for t in seen] == [(True, True), (True, False)]
