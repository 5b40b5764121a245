"""megatron_patches.options: one table builds both CLIs (train.py and the Megatron-LM launcher's
extra_args_provider) with the same names, meanings, choices, defaults and help; the layer-pattern
rules; every train.py flag documented; one options value (SPOptions) holding every rule, built
once per run. No process group, no Megatron import needed."""
import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from megatron_patches.args import add_arguments
from megatron_patches.options import (DEFAULT_SLOPE_SCHEDULE, SP_OPTIONS, SPOptions,
                                      default_hybrid_pattern, expand_pattern, model_pattern)
from sp_attention import SoftmaxSchedule
from sp_train.args import NEGATABLE, RENAMED, TrainArgs, build_parser, parse_args
from sp_attention.testing import run_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _actions(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def test_both_clis_list_the_same_options():
    launcher = _actions(add_arguments(argparse.ArgumentParser()))
    train = _actions(build_parser())
    ours = {s for s, a in launcher.items()} - {"-h", "--help"}
    assert ours == {o.flag for o in SP_OPTIONS}           # the launcher adds the table, only it
    defaults = TrainArgs.__dataclass_fields__
    for opt in SP_OPTIONS:
        a, b = launcher[opt.flag], train[opt.flag]
        assert (a.help, a.choices, a.type, a.dest) == (b.help, b.choices, b.type, b.dest), opt
        assert "(default: " in a.help and a.help.startswith(opt.help)
        assert a.default == opt.default == defaults[opt.dest].default, opt.flag
    assert launcher["--context-parallel-impl"].choices == train["--context-parallel-impl"].choices
    # one meaning: the scan (plus the launcher-only 'megatron', which train.py refuses)
    assert "ring_ag" not in launcher["--context-parallel-impl"].choices


def test_every_train_flag_has_help_choices_and_default():
    parser = build_parser()
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    hidden = {s for a in parser._actions if a.help == argparse.SUPPRESS for s in a.option_strings}
    assert hidden == set(RENAMED)                          # only the old spellings are hidden
    for a in shown:
        # the flags that turn another off (--fp32, --no-distributed-optimizer, ...) point to it
        off = a.option_strings == ["--fp32"] or a.option_strings[0] in NEGATABLE.values()
        assert a.help and "(default: " in a.help or off, a
        assert not a.help.startswith(" ("), a.option_strings  # a description before the default
    text = parser.format_help()
    for flag, values in (("--context-parallel-impl", "blelloch,allgather,ring,auto"),
                         ("--sp-slope-schedule", "long_range,lightning"),
                         ("--preset", "tiny,1b,8b")):
        assert f"{flag} {{{values}" in text, flag
    assert "tiny-linear" not in text
    flags = {s for a in shown for s in a.option_strings}
    assert {"--" + f.replace("_", "-") for f in TrainArgs.__dataclass_fields__
            if f not in ("set_by_user", "bf16")} <= flags


def test_old_spellings_still_work_with_one_note(capsys):
    a = parse_args(["--model-kind", "hybrid", "--hybrid-pattern", "LS", "--slope-schedule",
                    "lightning"])
    assert (a.sp_model_kind, a.sp_hybrid_pattern, a.sp_slope_schedule) == ("hybrid", "LS",
                                                                           "lightning")
    parse_args(["--model-kind", "linear"])
    err = capsys.readouterr().err
    assert err.count("--model-kind is now --sp-model-kind") <= 1   # once per process
    with pytest.raises(ValueError, match="invalid choice"):
        parse_args(["--model-kind", "mamba"])


def test_patterns():
    assert [default_hybrid_pattern(n) for n in (2, 3, 4, 5, 6, 8)] == \
        ["LS", "LLS", "LLLS", "LLLLS", "LLS", "LLLS"]
    assert expand_pattern("LS", 4) == "LSLS" and model_pattern("linear", 3) == "LLL"
    assert model_pattern("hybrid", 4) == "LLLS" and model_pattern("hybrid", 2, "SL") == "SL"
    with pytest.raises(ValueError, match="must divide 2: e.g. 'LS'"):
        expand_pattern("LLLS", 2)
    with pytest.raises(ValueError, match="e.g. 'LLS'"):
        expand_pattern("LX", 3)
    # gated linear layers: their own kind and letter, mixed freely with L and S
    assert model_pattern("gated", 2) == "GG" and model_pattern("hybrid", 6, "GLS") == "GLSGLS"
    assert parse_args(["--sp-model-kind", "gated", "--context-parallel-impl", "blelloch"]
                      ).sp_options.context_parallel_impl == "blelloch"      # G layers scan too
    with pytest.raises(ValueError, match="no linear layer with fixed slopes"):
        parse_args(["--sp-model-kind", "gated", "--sp-slope-schedule", "lightning"])
    with pytest.raises(ValueError, match="no linear layer with fixed slopes"):
        parse_args(["--sp-model-kind", "hybrid", "--sp-hybrid-pattern", "GS",
                    "--sp-slope-schedule", "lightning"])


def test_a_bad_command_line_prints_one_line_once(tmp_path):
    """Under torchrun every rank parses the same argv: rank 0 prints one line, the others
    nothing (no usage block), all exit 2 before any process group exists."""
    outs = []
    for rank in ("0", "1"):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
        # timeout: a hang detector (seconds without CPU progress), not a wall-clock limit
        p = run_process([sys.executable, "-c", "import runpy, sys; sys.argv = ['train.py', "
                         "'--preset', 'nope']; runpy.run_path('train.py', run_name='__main__')"],
                        env=env, timeout=120, cwd=ROOT)
        outs.append((p.returncode, p.stdout + p.stderr))
    (rc0, out0), (rc1, out1) = outs
    assert rc0 == rc1 == 2
    lines = [x for x in out0.splitlines() if x.strip()]
    assert len(lines) == 1 and "invalid choice: 'nope'" in lines[0], out0
    assert out1.strip() == "", out1


def test_cli_modules_import_no_megatron():
    """The option table, the launcher's arguments and train.py's argument checks (and so
    ``--help`` and every command-line error) need no Megatron import."""
    code = ("import sys, megatron_patches.options, megatron_patches.args, "
            "sp_train.args; print(sorted(m for m in sys.modules "
            "if m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --- the options object: every rule once, in SPOptions, naming the flag ----------------------
_HYBRID = dict(num_layers=4, model_kind="hybrid", num_attention_heads=8, num_query_groups=4,
               tensor_model_parallel_size=2)
RULES = [  # (changes to a valid hybrid, exception, the flag the message names)
    (dict(model_kind="mamba"), ValueError, "--sp-model-kind mamba: use one of"),
    (dict(hybrid_pattern="LLS"), ValueError, "--sp-hybrid-pattern: .* must divide 4"),
    (dict(context_parallel_impl="tree"), ValueError, "--context-parallel-impl tree: use one of"),
    (dict(context_parallel_impl="megatron"), ValueError,
     "need our scan; set --context-parallel-impl"),
    (dict(model_kind="softmax", context_parallel_impl="megatron",
          softmax_schedule=SoftmaxSchedule("ring_ag")), ValueError,
     "--softmax-cp-preset would be ignored with --context-parallel-impl megatron"),
    (dict(model_kind="softmax", context_parallel_impl="megatron", slope_schedule="lightning"),
     ValueError, "--sp-slope-schedule would be ignored with --context-parallel-impl megatron"),
    (dict(model_kind="softmax", context_parallel_impl="blelloch"), ValueError,
     "--context-parallel-impl blelloch does not fit --sp-model-kind softmax"),
    (dict(tensor_model_parallel_size=0), ValueError, "--tensor-model-parallel-size 0 must be"),
    (dict(tensor_model_parallel_size=3), ValueError,
     "must be divisible by --tensor-model-parallel-size 3"),
    (dict(model_kind="linear", softmax_schedule=SoftmaxSchedule(heads_k_stride=None,
                                                                preset="allgather")),
     ValueError, "--softmax-cp-preset would be ignored: the model has no softmax layer"),
    (dict(softmax_schedule=SoftmaxSchedule("ring_ag", heads_k_stride=4)), ValueError,
     "--softmax-heads-k-stride 4 must divide the 2 KV heads per TP rank"),
    (dict(softmax_schedule=SoftmaxSchedule("ring_ag", heads_k_stride=1,
                                           bwd_head_first_stride=1)), ValueError,
     "--softmax-bwd-head-first/last-stride"),
    (dict(slope_schedule="alibi"), ValueError, "--sp-slope-schedule alibi: use one of"),
    (dict(model_kind="gated", slope_schedule="lightning"), ValueError,
     "--sp-slope-schedule lightning would be ignored"),
    (dict(softmax_schedule="ring"), TypeError, "SoftmaxSchedule"),
]


@pytest.mark.parametrize("change, error, message", RULES, ids=[r[2][:40] for r in RULES])
def test_each_options_rule_names_its_flag(change, error, message):
    with pytest.raises(error, match=message):
        SPOptions(**dict(_HYBRID, **change))


def test_options_are_one_frozen_value():
    o = SPOptions(**_HYBRID, context_parallel_impl="blelloch")
    assert o.pattern == "LLLS" and o.layer_kinds == ("linear",) * 3 + ("softmax",)
    assert o.softmax_schedule == SoftmaxSchedule("auto") and o.slopes == DEFAULT_SLOPE_SCHEDULE
    assert o.kv_heads_per_tp_rank == 2 and o.has_scan and o.has_softmax
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.context_parallel_impl = "ring"
    assert SPOptions.from_layer_kinds(["gated", "softmax"]).pattern == "GS"
    assert SPOptions.from_layer_kinds(["linear"] * 2).model_kind == "linear"
    with pytest.raises(ValueError, match="num_layers 4 .the model: 6."):
        o.with_model(num_layers=6)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 3"):   # rules run again
        SPOptions(4, "hybrid").with_model(num_attention_heads=8, num_query_groups=4,
                                          tensor_model_parallel_size=3)


def _launcher_args(*argv, **megatron):
    ns = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    base = dict(context_parallel_size=2, tensor_model_parallel_size=2, seq_length=64,
                num_attention_heads=8, num_query_groups=4, group_query_attention=True,
                num_layers=4, spec=None)
    for k, v in dict(base, **megatron).items():
        setattr(ns, k, v)
    return ns


def test_options_are_built_once_per_run(monkeypatch):
    """train.py: parse_args builds the options; the model, the header, the memory estimate and
    the layout read them. The launcher: validate_args builds them; the model provider and
    every prebuilt-spec layer read what it kept."""
    import megatron_patches.args as margs
    from sp_attention import build_sp_context
    from sp_train.progress import describe_attention
    from sp_train.setup import memory_estimate
    built = []
    check = SPOptions.__post_init__
    monkeypatch.setattr(SPOptions, "__post_init__", lambda self: built.append(1) or check(self))
    args = parse_args(["--sp-model-kind", "hybrid", "--context-parallel-impl", "blelloch"])
    layout = args.layout(4)
    describe_attention(args.sp_options, build_sp_context(None))
    memory_estimate(args, layout, 128, bf16=False)
    assert args.layer_kinds() == "LS" and len(built) == 1
    ns = _launcher_args("--sp-model-kind", "hybrid", "--context-parallel-impl", "ring")
    options = margs.validate_args(ns)
    assert all(margs.options_of(ns) is options for _ in range(4)) and len(built) == 2
