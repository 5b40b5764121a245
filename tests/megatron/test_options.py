"""megatron_patches.options: one table builds both CLIs (train.py and the Megatron-LM launcher's
extra_args_provider) with the same names, meanings, choices, defaults and help; the layer-pattern
rules; every train.py flag documented. No process group, no Megatron import needed."""
import argparse
import os
import subprocess
import sys

import pytest

from megatron_patches.args import add_arguments
from megatron_patches.options import (SP_OPTIONS, default_hybrid_pattern, expand_pattern,
                                      model_pattern)
from megatron_patches.trainer.args import RENAMED, TrainArgs, build_parser, parse_args
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
        assert a.help and "(default: " in a.help or a.option_strings == ["--fp32"], a
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
                      ).model_options()["cp_impl"] == "blelloch"      # G layers scan too
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
            "megatron_patches.trainer.args; print(sorted(m for m in sys.modules "
            "if m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
