"""train.py's command line: Megatron's names for Megatron's knobs, our shared option table
(:mod:`megatron_patches.options`, the same as the Megatron-LM launcher's) for ours, shape
presets, per-model-kind defaults, and every check that can fail *before* a process group or a
model exists.

``parse_args(argv)`` returns a :class:`TrainArgs` (a dataclass whose ``__post_init__`` refuses
bad combinations with the fix in the message); ``TrainArgs.layout(world_size)`` adds the checks
that need the world size and returns the :class:`Layout` (TP, CP, DP, micro-batches). All of
this is pure Python, so every rank raises the same :class:`UsageError` before the first
collective (train.py prints it once, from rank 0). Each flag's help, choices and default live
on its field (``metadata``) or in the shared table; ``--help`` lists them all.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

from megatron_patches.options import (MODEL_KINDS, SPOptions, UsageError, expand_pattern,
                                      option, seq_multiple)
from megatron_patches.rotary import check_rope_scaling
from megatron_patches.weights import HFArchitecture
from .data import ENCODINGS as DATA_ENCODINGS
from .data import PACKINGS
from .loss import LOSS_IMPLS
from .recompute import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, RECOMPUTE_MODULES, Recompute

__all__ = ["SHAPES", "PRESETS", "KIND_DEFAULTS", "KindDefaults", "MODEL_KINDS", "TrainArgs",
           "Layout", "UsageError", "build_parser", "parse_args", "default_context_parallel_size"]


# Llama shapes (1b = Llama-3.2-1B, 8b = Llama-3-8B). "tiny" is per model kind (KIND_DEFAULTS).
SHAPES: dict[str, dict] = {
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, seq_length=4096),
    "8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=14336, seq_length=8192),
}
PRESETS = ("tiny",) + tuple(SHAPES)
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "seq_length")


@dataclass(frozen=True)
class KindDefaults:
    """train.py's defaults for one ``--sp-model-kind``: what its default run (the copy task on
    CPU) needs to learn far below chance. A new model kind adds one row to
    :data:`KIND_DEFAULTS` (and a CPU test of its default run, tests/train).

    Attributes:
        tiny: the ``--preset tiny`` shape (the SHAPE_KEYS).
        lr: peak learning rate (``--lr``).
        train_iters: steps (``--train-iters``).
    """

    tiny: dict
    lr: float
    train_iters: int


_TINY = dict(num_layers=2, num_attention_heads=4, num_query_groups=4, seq_length=256)
# Measured on CPU, copy task (chance ln 32 = 3.466), final loss of the default run; more in
# sp_train/README.md. Linear attention needs head dim >= 32 to learn the copy
# and learns it slowly: a plateau to ~100 steps, then 200 steps end at 2.10, 300 at 1.10,
# 400 at 0.67-0.84 (lr 3e-3 / 4e-3 and head dim 64 were slower). Gated (linear's shape and
# steps, Mamba2-initialised gates): at chance to ~120 steps, 1.81 at 220, 0.61-0.88 at 400. The
# hybrid (LS) sits at chance to ~200 steps (3.46 there) and ends 400 at 0.0011. (SL, softmax first, ends 200
# steps at 0.036, but its fp32 losses drift apart across TP/CP layouts faster than LS's —
# 2e-5 by step 4, past the parity test's 1e-5 — so LS stays the pattern.)
KIND_DEFAULTS: dict[str, KindDefaults] = {
    "softmax": KindDefaults(tiny=dict(_TINY, hidden_size=64, ffn_hidden_size=256), lr=2e-3,
                            train_iters=200),
    "linear": KindDefaults(tiny=dict(_TINY, hidden_size=128, ffn_hidden_size=512), lr=2e-3,
                           train_iters=400),
    "gated": KindDefaults(tiny=dict(_TINY, hidden_size=128, ffn_hidden_size=512), lr=2e-3,
                          train_iters=400),
    "hybrid": KindDefaults(tiny=dict(_TINY, hidden_size=128, ffn_hidden_size=512), lr=2e-3,
                           train_iters=400),
}
assert set(KIND_DEFAULTS) == set(MODEL_KINDS), "every model kind needs train.py defaults"


def _f(default: Any = None, help: str = "", choices: Optional[tuple] = None,
       default_help: Optional[str] = None, flag: Optional[str] = None,
       nargs: Optional[str] = None):
    """A TrainArgs field with its command-line help (and choices, how --help names a default
    that is a rule, and ``nargs`` for a list)."""
    return field(default=default, metadata=dict(help=help, choices=choices,
                                                default_help=default_help, flag=flag,
                                                nargs=nargs))


def _sp(dest: str):
    """A field of the shared option table (megatron_patches.options): its default and help."""
    return field(default=option(dest).default, metadata=dict(sp=True))


@dataclass
class TrainArgs:
    """Everything train.py needs; field names are the flags' (``--dashed-names``). Built, it
    also holds ``sp_options``: our attention options as one checked
    :class:`~megatron_patches.options.SPOptions` (built once, here; the model, the header and
    the memory estimate read it)."""
    sp_model_kind: str = _sp("sp_model_kind")
    preset: str = _f("tiny", "model shape: tiny (per --sp-model-kind: d64 softmax, d128 linear "
                     "and hybrid, 2 layers, 256 tokens; learns the copy task on CPU), 1b "
                     "(Llama-3.2-1B), 8b (Llama-3-8B); the shape flags below override it",
                     choices=PRESETS)
    num_layers: Optional[int] = _f(help="transformer layers", default_help="the preset's")
    hidden_size: Optional[int] = _f(help="model width", default_help="the preset's")
    num_attention_heads: Optional[int] = _f(help="query heads", default_help="the preset's")
    num_query_groups: Optional[int] = _f(help="KV heads (GQA); must divide the query heads",
                                         default_help="the preset's, at most the query heads")
    ffn_hidden_size: Optional[int] = _f(help="SwiGLU width", default_help="the preset's")
    seq_length: Optional[int] = _f(help="tokens per sequence", default_help="the preset's, "
                                   "rounded up to a multiple of the CP layout's chunks")
    load_hf: Optional[str] = _sp("load_hf")
    norm_epsilon: Optional[float] = _f(help="RMSNorm epsilon", default_help="1e-5, or the "
                                       "--load-hf config's rms_norm_eps")
    rotary_base: Optional[float] = _f(help="RoPE base θ (e.g. a larger one to continue a "
                                      "checkpoint at a longer --seq-length)",
                                      default_help="10000, or the --load-hf config's")
    rope_scaling_factor: Optional[float] = _f(
        help="RoPE frequency scaling factor: the --load-hf config's scaling (llama3 or linear) "
        "with this factor, or, without one, Llama 3's scaling (low/high frequency factors 1 "
        "and 4, original context 8192)", default_help="the --load-hf config's scaling; none "
        "without --load-hf")
    sp_hybrid_pattern: Optional[str] = _sp("sp_hybrid_pattern")
    sp_slope_schedule: Optional[str] = _sp("sp_slope_schedule")
    tensor_model_parallel_size: int = _f(1, "TP: ranks sharing each layer's heads")
    context_parallel_size: Optional[int] = _f(
        help="CP: ranks sharing each sequence; DP = world / (TP·CP)",
        default_help="CP ≥ 2 at any world size ≥ 2: world / (TP·DP) with DP the largest "
        "divisor of world / (TP·p) that divides the global batch, p the smallest prime factor "
        "of world / TP (world 4: CP 2 · DP 2; world 3: CP 3; world 8: CP 2 · DP 4)")
    context_parallel_impl: Optional[str] = _sp("context_parallel_impl")
    linear_op_graphs: bool = _sp("linear_op_graphs")
    softmax_cp_preset: Optional[str] = _sp("softmax_cp_preset")
    softmax_heads_k_stride: Optional[int] = _sp("softmax_heads_k_stride")
    softmax_bwd_head_first_stride: Optional[int] = _sp("softmax_bwd_head_first_stride")
    softmax_bwd_head_last_stride: Optional[int] = _sp("softmax_bwd_head_last_stride")
    softmax_a2a_size: Optional[int] = _sp("softmax_a2a_size")
    local_attention_only: bool = _f(False, "baseline that breaks CP on purpose: each rank "
                                    "attends only to its own shard of the sequence")
    micro_batch_size: Optional[int] = _f(help="sequences per forward/backward on a DP rank "
                                         "(--packing documents: rows laid end to end into one "
                                         "packed row)", default_help="global batch / DP (no "
                                         "accumulation); 1 with --packing documents (Megatron's "
                                         "rule for packed sequences: a micro-batch is one row)")
    recompute_granularity: Optional[str] = _f(
        help="activation recompute (Megatron's flag): selective (--recompute-modules of every "
        "layer) or full (whole layers); auto (ours): the setting that replays the fewest "
        "FLOPs among those whose memory estimate fits the GPU, printed at the start",
        choices=RECOMPUTE_GRANULARITIES + ("auto",), default_help="none")
    recompute_method: Optional[str] = _f(
        help="full recompute: uniform (groups of --recompute-num-layers layers) or block (the "
        "first --recompute-num-layers layers)", choices=RECOMPUTE_METHODS,
        default_help="uniform with --recompute-granularity full")
    recompute_num_layers: Optional[int] = _f(help="full recompute: N layers",
                                             default_help="uniform 1, block all layers")
    recompute_modules: Optional[list] = _f(
        help="selective recompute: the submodules each layer replays", choices=RECOMPUTE_MODULES,
        nargs="+", default_help="core_attn")
    loss_impl: str = _f("chunked", "chunked: linear + cross entropy in token chunks, never the "
                        "full logits (vocabulary-parallel under TP); liger: Liger-Kernel's fused "
                        "linear cross entropy (TP 1, CUDA); megatron: the model's output layer "
                        "and Megatron's cross entropy over the full logits", choices=LOSS_IMPLS)
    no_overlap_grad_reduce: bool = _f(False, "sum the gradients over DP × CP after the backward "
                                      "instead of bucket by bucket during the last "
                                      "micro-batch's backward (same numbers)")
    use_distributed_optimizer: Optional[bool] = _f(
        help="shard AdamW's fp32 masters and moments and the fp32 gradient sum over the DP × "
             "CP ranks (ZeRO-1, Megatron's flag): the sum becomes a reduce-scatter, each rank "
             "steps its slice, the parameters are all-gathered; same numbers, 12-13 GiB less "
             "per GPU for the 1B model at CP 4, checkpoints in the same format (resume with or "
             "without it); --no-distributed-optimizer: the replicated optimizer and an "
             "all-reduce",
        default_help="on for runs on GPUs, off on CPU; nothing to shard on one DP × CP rank")
    overlap_param_gather: Optional[bool] = _f(
        help="with the distributed optimizer: the step only launches the parameters' "
             "all-gathers; the next forward waits for each bucket where it first needs it "
             "(Megatron's flag; same numbers); --no-overlap-param-gather: the gathers finish "
             "in the step",
        default_help="on with the distributed optimizer")
    manual_gc: bool = _f(False, "Python's garbage collector only every --manual-gc-interval "
                         "steps, at the same step on every rank (objects made before the first "
                         "step frozen out of it), instead of whenever allocations cross its "
                         "thresholds, when a collection can pause one rank's host at a random "
                         "point while the others wait for it at the next collective (Megatron's "
                         "flag; no gain measured at CP 4 with 32K tokens on 4 × H200)")
    manual_gc_interval: int = _f(100, "with --manual-gc: collect every N steps (0: never "
                                 "during training)")
    cuda_graphs: Optional[bool] = _f(
        help="replay every transformer layer's forward and backward from CUDA graphs captured "
             "at the first step (torch's make_graphed_callables): the host issues one launch "
             "per layer instead of ~150, for steps whose hosts fall behind their GPUs (CP > "
             "1); same numbers; fixed shapes only (no --packing documents, no recompute); "
             "measured at CP 4, 32K: hybrid 32.8 -> 35.7 %% MFU; --no-cuda-graphs: the layers "
             "run eagerly",
        default_help="on for CP > 1 on GPUs when the shapes are fixed (--packing none) and "
                     "nothing is recomputed; off otherwise")
    no_memory_check: bool = _f(False, "start even when the memory estimate printed before the "
                               "model is built exceeds the GPU")
    global_batch_size: int = _f(16, "sequences per step over all DP ranks")
    lr: Optional[float] = _f(help="peak learning rate (cosine schedule)",
                             default_help="per --sp-model-kind: " + ", ".join(
                                 f"{k} {v.lr:g}" for k, v in KIND_DEFAULTS.items()))
    min_lr: Optional[float] = _f(help="final learning rate", default_help="lr / 10")
    lr_warmup_iters: int = _f(10, "linear warm-up steps")
    train_iters: Optional[int] = _f(help="training steps", default_help="per --sp-model-kind: "
                                    + ", ".join(f"{k} {v.train_iters}"
                                                for k, v in KIND_DEFAULTS.items()))
    weight_decay: float = _f(0.0, "AdamW weight decay")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.95, "AdamW beta2")
    seed: int = _f(1234, "seed of the weights and the data")
    bf16: Optional[bool] = _f(help="bf16 parameters and compute (--fp32: fp32)",
                              default_help="bf16 on GPUs, fp32 on CPU")
    data_path: Optional[str] = _f(help="a .txt or .jsonl ({\"text\": ...} per line) file",
                                  default_help="the generated copy task")
    tokenizer_model: Optional[str] = _f(help="HF tokenizer name or directory for --data-path "
                                        "(needs transformers)", default_help="UTF-8 bytes")
    data_encoding: str = _f("utf-8", "--data-path's encoding: utf-8 (invalid text is an error "
                            "naming file and line) or bytes (train on the raw bytes as they are)",
                            choices=DATA_ENCODINGS)
    packing: Optional[str] = _f(
        help="documents: each row holds several documents with their boundaries, attention "
        "stays inside each document across CP ranks and positions restart per document "
        "(--data-path: a sample's documents, split at end-of-document tokens; the copy task: "
        "rows of independent copy documents of random lengths); none: each row is one "
        "sequence (--data-path: attention runs across documents; the copy task: one copy per "
        "row)", choices=PACKINGS, default_help="documents with --data-path, none for the copy "
        "task")
    copy_vocab: int = _f(32, "copy task: distinct random tokens (chance loss = ln of this)")
    vocab_size: Optional[int] = _f(help="copy task: output-layer size (e.g. 128256 to time a "
                                   "Llama head)", default_help="just enough")
    save: Optional[str] = _f(help="checkpoint directory to write", default_help="no checkpoints")
    load: Optional[str] = _f(help="checkpoint directory to resume from (= --save may not exist "
                             "yet: requeue-friendly)", default_help="start fresh")
    save_interval: int = _f(0, "save every N steps (0: at the end and on SIGTERM only)")
    ckpt_step: Optional[int] = _f(help="resume from this step's checkpoint under --load",
                                  default_help="the newest")
    no_checkpoint_checksums: bool = _f(False, "skip the CRC-32 of every checkpoint file at save "
                                       "and its check at load (sizes are still checked)")
    log_interval: int = _f(10, "a log line every N steps when stdout is not a terminal")
    log_dir: Optional[str] = _f(help="where log.jsonl, run.json (which run owns the folder), "
                                "loss.png, summary.json and tensorboard/ go; a folder holding "
                                "another run's log is refused", default_help="runs/<model "
                                "kind>, runs/<model kind>-local with --local-attention-only")
    tensorboard_dir: Optional[str] = _f(help="TensorBoard logs", default_help="LOG_DIR/tensorboard")
    log_json: Optional[str] = _f(help="JSON lines, one per step", default_help="LOG_DIR/log.jsonl")
    loss_png: Optional[str] = _f(help="loss curve", default_help="LOG_DIR/loss.png")
    peak_tflops: Optional[float] = _f(help="GPU peak for MFU", default_help="known GPUs: "
                                      "H100/H200/GH200 989, B200 2250, A100 312")
    no_progress_bar: bool = _f(False, "log lines instead of a progress bar")
    distributed_timeout_minutes: int = _f(10, "collective timeout")
    # not a flag: which flags the command line set (errors name them, defaults can adapt);
    # None (built in code): every field that differs from its default
    set_by_user: Optional[tuple] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.set_by_user is None:
            self.set_by_user = tuple(f.name for f in fields(self) if f.name != "set_by_user"
                                     and getattr(self, f.name) != f.default)
        self.hf = self._hf_architecture()
        kind = self.sp_model_kind
        if kind not in KIND_DEFAULTS:
            raise UsageError(f"--sp-model-kind {kind!r}: use one of {MODEL_KINDS}")
        if self.preset not in PRESETS:
            raise UsageError(f"--preset {self.preset!r}: use one of {PRESETS}")
        self._rope_and_norms()
        for k, v in self.preset_shape().items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.num_query_groups > self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        defaults = KIND_DEFAULTS[kind]
        self.lr = defaults.lr if self.lr is None else self.lr
        self.min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        self.train_iters = defaults.train_iters if self.train_iters is None else self.train_iters
        self.log_dir = self.log_dir or os.path.join(
            "runs", kind + ("-local" if self.local_attention_only else ""))
        self.log_json = self.log_json or os.path.join(self.log_dir, "log.jsonl")
        self.loss_png = self.loss_png or os.path.join(self.log_dir, "loss.png")
        self.tensorboard_dir = self.tensorboard_dir or os.path.join(self.log_dir, "tensorboard")
        self._check_model()
        self._check_training()

    def _hf_architecture(self) -> Optional[HFArchitecture]:
        """``--load-hf``'s architecture, its flag values set here; a flag given with another
        value is refused by name."""
        if self.load_hf is None:
            return None
        try:
            arch = HFArchitecture.from_dir(self.load_hf)
        except ValueError as e:
            msg = str(e)
            raise UsageError(msg if msg.startswith("--load-hf") else
                             f"--load-hf {self.load_hf}: {msg}") from None
        if self._given("preset"):
            raise UsageError(f"--preset and --load-hf both give the model's shape; drop --preset "
                             f"(the shape comes from {self.load_hf}/config.json)")
        given = dict(arch.flags(), vocab_size=arch.vocab_size)
        for name, value in given.items():
            mine = getattr(self, name)
            if not self._given(name) or mine == value or (
                    name == "sp_hybrid_pattern" and mine and value
                    and arch.num_layers % len(mine) == 0
                    and expand_pattern(mine, arch.num_layers) == value):
                setattr(self, name, value)
                continue
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {mine} contradicts --load-hf {self.load_hf}: its "
                             f"config.json says {value}; drop {flag} (the architecture comes "
                             "from the checkpoint)")
        return arch

    def _rope_and_norms(self) -> None:
        """RoPE θ and scaling, the norms' epsilon and the tied embeddings: the flags, else the
        ``--load-hf`` config, else the defaults."""
        hf = self.hf
        if self.norm_epsilon is None:
            self.norm_epsilon = hf.norm_epsilon if hf else 1e-5
        if self.rotary_base is None:
            self.rotary_base = hf.rotary_base if hf else 10000.0
        if not self.norm_epsilon > 0 or not self.rotary_base > 0:
            raise UsageError("--norm-epsilon and --rotary-base must be > 0")
        scaling = hf.rope_scaling if hf else None
        if self.rope_scaling_factor is not None:
            scaling = dict(scaling or {"rope_type": "llama3", "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                           factor=self.rope_scaling_factor)
        try:
            self.rope_scaling = check_rope_scaling(scaling)
        except ValueError as e:
            raise UsageError(f"--rope-scaling-factor: {e}") from None
        self.tie_embeddings = bool(hf and hf.tie_word_embeddings)

    def preset_shape(self) -> dict:
        """The shape ``--preset`` gives this model kind (``--load-hf``: the checkpoint's, with
        its context length up to 4096 tokens)."""
        if self.hf is not None:
            keys = SHAPE_KEYS[:-1]
            return dict({k: getattr(self.hf, k) for k in keys},
                        seq_length=min(self.hf.max_position_embeddings, 4096))
        if self.preset == "tiny":
            return dict(KIND_DEFAULTS[self.sp_model_kind].tiny)
        return dict(SHAPES[self.preset])

    def _check_model(self) -> None:
        h, heads, g = self.hidden_size, self.num_attention_heads, self.num_query_groups
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if h % heads:
            raise UsageError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                             f"{heads}; pick a head count that divides it")
        head_dim = h // heads
        if head_dim % 2:        # RoPE rotates pairs of channels
            raise UsageError(f"--hidden-size {h} / --num-attention-heads {heads} gives head dim "
                             f"{head_dim}: RoPE rotates pairs of channels, so the head dim must "
                             f"be even; e.g. --hidden-size {heads * (head_dim + 1)} or "
                             f"--num-attention-heads dividing {h} into an even head dim")
        if heads % g:
            raise UsageError(f"--num-attention-heads {heads} is not divisible by "
                             f"--num-query-groups {g}; use a divisor of the head count")
        try:        # every rule between our options, heads divisible by TP: SPOptions'
            self.sp_options = SPOptions.from_flags(
                self, num_layers=self.num_layers, num_attention_heads=heads,
                num_query_groups=g, tensor_model_parallel_size=self.tensor_model_parallel_size,
                context_parallel_size=self.context_parallel_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.sp_options.megatron_attention:
            raise UsageError("--context-parallel-impl megatron (Megatron/TransformerEngine "
                             "attention) is the Megatron-LM launcher's (python -m "
                             "megatron_patches.pretrain_gpt); train.py runs our CP attention: "
                             "drop it or pick auto, blelloch, allgather or ring")

    def _check_training(self) -> None:
        for name in ("train_iters", "global_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if self.data_path is not None and not os.path.exists(self.data_path):
            raise UsageError(f"--data-path {self.data_path!r} does not exist; give a .txt or "
                             ".jsonl file (or leave it out to train on the generated copy task)")
        resume_own = self.load is not None and self.load == self.save   # requeue-friendly
        if self.load is not None and not os.path.isdir(self.load) and not resume_own:
            raise UsageError(f"--load {self.load!r} is not a directory; point it at a --save "
                             "directory of an earlier run (or leave it out to start fresh)")
        if self.ckpt_step is not None and self.load is None:
            raise UsageError("--ckpt-step picks a checkpoint under --load: pass --load DIR too")
        if self.manual_gc_interval < 0:
            raise UsageError("--manual-gc-interval must be >= 0 (0: no collection during "
                             "training)")
        if self.overlap_param_gather and self.use_distributed_optimizer is False:
            raise UsageError("--overlap-param-gather overlaps the distributed optimizer's "
                             "parameter all-gather: drop --no-distributed-optimizer")
        if self.data_encoding not in DATA_ENCODINGS:
            raise UsageError(f"--data-encoding {self.data_encoding!r}: use one of "
                             f"{DATA_ENCODINGS}")
        if self.packing is None:
            self.packing = "none" if self.data_path is None else "documents"
        if self.packing not in PACKINGS:
            raise UsageError(f"--packing {self.packing!r}: use one of {PACKINGS}")
        if self.cuda_graphs and self.packing == "documents":
            raise UsageError("--cuda-graphs replays fixed shapes: packed documents change "
                             "shape every batch; drop --cuda-graphs or use --packing none")
        if self.cuda_graphs and self.linear_op_graphs:
            raise UsageError("--cuda-graphs captures whole layers, the linear ops with them: "
                             "--linear-op-graphs would only add its own graphs' memory; drop "
                             "one of them")
        if self.recompute_granularity == "auto":
            given = [f"--{n.replace('_', '-')}" for n in ("recompute_method",
                                                          "recompute_num_layers",
                                                          "recompute_modules")
                     if getattr(self, n) is not None]
            if given:
                raise UsageError(f"--recompute-granularity auto chooses {' and '.join(given)} "
                                 "itself: drop them, or name the granularity")
            if self.cuda_graphs:
                raise UsageError("--cuda-graphs cannot replay a layer that recomputes its "
                                 "activations, which --recompute-granularity auto may choose: "
                                 "drop one of them")
        elif self.cuda_graphs and self.recompute().granularity is not None:
            raise UsageError("--cuda-graphs cannot replay a layer that recomputes its "
                             "activations: drop --recompute-granularity or --cuda-graphs")
        if self.data_encoding == "bytes" and self.tokenizer_model:
            raise UsageError("--data-encoding bytes trains on raw bytes; a --tokenizer-model "
                             "needs text: leave one of them out")
        if self.copy_vocab < 2:
            raise UsageError("--copy-vocab must be >= 2")
        if self.save_interval < 0 or self.log_interval < 1:
            raise UsageError("--save-interval must be >= 0 and --log-interval >= 1")
        if self.loss_impl not in LOSS_IMPLS:
            raise UsageError(f"--loss-impl {self.loss_impl!r}: use one of {LOSS_IMPLS}")
        if self.recompute_granularity != "auto":
            self.recompute()               # its checks, with the fix in the message

    def resolve_optimizer(self, cuda: bool) -> None:
        """The optimizer's defaults for the device (the one home of that rule): the
        distributed optimizer with the overlapped parameter gather on GPUs (measured faster
        at CP 4 on 4 × H200, and 12-13 GiB less per GPU), the replicated one on CPU; flags
        given win. Raises for ``--overlap-param-gather`` without the distributed optimizer."""
        if self.use_distributed_optimizer is None:
            self.use_distributed_optimizer = cuda
        if self.overlap_param_gather is None:
            self.overlap_param_gather = self.use_distributed_optimizer
        elif self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UsageError("--overlap-param-gather overlaps the distributed optimizer's "
                             "parameter all-gather, which is off on CPU: add "
                             "--use-distributed-optimizer")

    def resolve_cuda_graphs(self, cuda: bool, cp: int) -> None:
        """``--cuda-graphs`` unset: on where it was measured to pay and can replay (the one
        home of that rule) — CP > 1 on GPUs (at CP 4, 32K, 1B on 4 × H200: hybrid 214.9 ->
        192.5 ms a step, gated 220 -> 200, softmax 298.3 -> 296.8 with 2 GiB less), fixed
        shapes (no packed documents), no activation recompute (call after
        ``--recompute-granularity auto`` is resolved) and no --linear-op-graphs. A flag given
        wins."""
        if self.cuda_graphs is None:
            self.cuda_graphs = (cuda and cp > 1 and self.packing == "none"
                                and not self.linear_op_graphs
                                and self.recompute().granularity is None)

    def check_graph_flags(self, cuda: bool) -> None:
        """The flags that replay CUDA graphs need GPUs: raise naming the flag off CUDA."""
        for flag in ("cuda_graphs", "linear_op_graphs"):
            if getattr(self, flag) and not cuda:
                raise UsageError(f"--{flag.replace('_', '-')} replays CUDA graphs: run on GPUs "
                                 "or drop it")

    def recompute(self) -> Recompute:
        """The validated ``--recompute-*`` settings (``auto`` resolved first:
        :func:`sp_train.setup.resolve_auto_recompute`)."""
        if self.recompute_granularity == "auto":
            raise UsageError("--recompute-granularity auto is resolved against the device's "
                             "memory before the model is built (train.py does it)")
        try:
            return Recompute.from_flags(self.recompute_granularity, self.recompute_method,
                                        self.recompute_num_layers, self.recompute_modules,
                                        self.num_layers)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def _given(self, name: str) -> bool:
        return name in self.set_by_user

    def layer_kinds(self) -> str:
        """One letter per layer: S softmax, L linear, G gated."""
        return self.sp_options.pattern

    def flag_values(self) -> dict:
        """The parsed flags (every field), e.g. for a checkpoint's record of its run."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "set_by_user"}

    def model_signature(self) -> dict:
        """What a checkpoint must match to load (see checkpoint.check_compatible)."""
        keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size")
        tied = {"tie_embeddings": True} if self.tie_embeddings else {}
        return ({"model_kind": self.sp_model_kind} | {k: getattr(self, k) for k in keys}
                | {"layers": self.layer_kinds()} | tied)

    def hf_export(self, vocab_size: int) -> dict:
        """What ``python -m sp_train.export_hf`` needs beyond the weights to write an HF
        config (kept in each checkpoint's meta.json): ``vocab_size``, the model's vocabulary
        (padded; an HF start's own vocabulary instead)."""
        hf = self.hf
        return {"model_type": hf.model_type if hf else
                ("llama" if self.sp_model_kind == "softmax" else "sp_linear_llama"),
                "vocab_size": hf.vocab_size if hf else vocab_size,
                "tie_word_embeddings": self.tie_embeddings, "rotary_base": self.rotary_base,
                "rope_scaling": self.rope_scaling, "norm_epsilon": self.norm_epsilon,
                "max_position_embeddings": max(self.seq_length,
                                               hf.max_position_embeddings if hf else 0),
                "slope_schedule": self.sp_options.slopes if "L" in self.layer_kinds() else None,
                "layer_kinds": list(self.sp_options.layer_kinds)}

    def layout(self, world_size: int) -> Layout:
        """Check the parallel sizes against ``world_size``; return the layout. A sequence
        length taken from the preset is rounded up to the CP layout's multiple (so the default
        run works at every CP size); one given with --seq-length must already be one."""
        tp, cp = self.tensor_model_parallel_size, self.context_parallel_size
        if cp is not None and cp < 1:       # TP >= 1: SPOptions' rule
            raise UsageError("--context-parallel-size must be >= 1")
        if cp is None:
            if world_size % tp:
                raise UsageError(f"world size {world_size} is not divisible by "
                                 f"--tensor-model-parallel-size {tp}; launch a multiple of {tp} "
                                 "processes")
            cp = default_context_parallel_size(world_size // tp, self.global_batch_size,
                                               self.micro_batch_size)
        elif world_size % (tp * cp):
            raise UsageError(f"world size {world_size} is not divisible by TP×CP = {tp}×{cp}; "
                             f"launch a multiple of {tp * cp} processes or change "
                             "--tensor-model-parallel-size / --context-parallel-size")
        self._fit_seq_length(cp)
        if self.ffn_hidden_size % tp:
            raise UsageError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                             f"TP = {tp}")
        dp = world_size // (tp * cp)
        return Layout(tp, cp, dp, *self._micro_batches(dp, cp))

    def _fit_seq_length(self, cp: int) -> None:
        multiple = seq_multiple(cp)
        if not self._given("seq_length"):
            # the copy task needs an even length as well
            step = multiple * 2 // math.gcd(multiple, 2)
            self.seq_length = -(-self.preset_shape()["seq_length"] // step) * step
        elif self.seq_length % multiple:
            what = "2·CP" if multiple == 2 * cp else "CP"
            cp_note = ("" if self._given("context_parallel_size") else
                       f" (CP {cp} is the default for this world size; "
                       "--context-parallel-size picks another)")
            raise UsageError(f"--seq-length {self.seq_length} is not divisible by {what} = "
                             f"{multiple} (the CP layout's chunks){cp_note}; use a multiple "
                             f"of {multiple}")

    def _micro_batches(self, dp: int, cp: int) -> tuple[int, int]:
        gb, mbs = self.global_batch_size, self.micro_batch_size
        if mbs is None and self.packing == "documents":
            mbs = 1
        gb_flag = "--global-batch-size" + ("" if self._given("global_batch_size")
                                           else " (default)")
        cp_hint = (" or another --context-parallel-size" if self._given("context_parallel_size")
                   else "")
        if mbs is not None:
            if mbs < 1 or gb % (mbs * dp):
                raise UsageError(f"{gb_flag} {gb} is not divisible by --micro-batch-size × DP = "
                                 f"{mbs}×{dp}; pick a global batch that is a multiple of "
                                 f"{mbs * dp}{cp_hint}")
            return mbs, gb // (mbs * dp)
        if gb % dp:
            raise UsageError(f"{gb_flag} {gb} is not divisible by DP = {dp} (world / (TP·CP "
                             f"{cp})); pick a global batch that is a multiple of {dp}{cp_hint}")
        return gb // dp, 1


def default_context_parallel_size(n: int, global_batch: int,
                                  micro_batch: Optional[int] = None) -> int:
    """CP when ``--context-parallel-size`` is not given, for ``n = world / TP`` ranks: CP ≥ 2
    whenever ``n ≥ 2`` (every CP size works), DP the largest divisor of ``n / p`` (``p``: the
    smallest prime factor of ``n``) that divides the global batch (in micro-batches), CP =
    n / DP. n = 2 → CP 2; 4 → CP 2 · DP 2; 8 → CP 2 · DP 4; 3 → CP 3; 6 → CP 6 with a global
    batch of 16 (CP 2 · DP 3 with 48)."""
    if n <= 1:
        return 1
    p = next(d for d in range(2, n + 1) if n % d == 0)
    rows = global_batch // micro_batch if micro_batch and global_batch % micro_batch == 0 \
        else global_batch
    dp = max(d for d in range(1, n // p + 1) if (n // p) % d == 0 and rows % d == 0)
    return n // dp


@dataclass(frozen=True)
class Layout:
    """How the world splits: global rank = tp_rank + TP·(cp_rank + CP·dp_rank) (Megatron's
    tp-cp-dp order)."""
    tp: int
    cp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int

    def summary(self) -> str:
        return (f"TP{self.tp}·CP{self.cp}·DP{self.dp} (world {self.tp * self.cp * self.dp}), "
                f"micro-batch {self.micro_batch_size} × {self.num_micro_batches} per DP rank")


# --- the parser ----------------------------------------------------------------------------
# Old spellings of renamed flags: still accepted, with a note (once, from rank 0).
RENAMED = {"--model-kind": "--sp-model-kind", "--hybrid-pattern": "--sp-hybrid-pattern",
           "--slope-schedule": "--sp-slope-schedule"}
_NOTED: set = set()


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if option_string not in _NOTED and _rank0():
            _NOTED.add(option_string)
            print(f"train.py: note: {option_string} is now {RENAMED[option_string]} (the same "
                  "name as the Megatron-LM launcher's); the old spelling will be removed",
                  file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """Errors raise :class:`UsageError` (one line, printed once by train.py) instead of
    printing the usage block and exiting on every rank."""

    def error(self, message: str):
        if "--context-parallel-impl" in message and any(
                f"'{p}'" in message for p in ("ring_ag", "ag_ring")):
            message += ("; the softmax schedule is --softmax-cp-preset, --context-parallel-impl "
                        "picks the linear layers' scan")
        raise UsageError(f"{message} (python train.py --help lists the flags)")


def _python_type(f) -> Any:
    name = str(f.type).replace("Optional[", "").rstrip("]")
    return {"int": int, "float": float}.get(name, str)


# tri-state flags (unset: the rule in their help) and the flag that turns each off
NEGATABLE = {"use_distributed_optimizer": "--no-distributed-optimizer",
             "overlap_param_gather": "--no-overlap-param-gather",
             "cuda_graphs": "--no-cuda-graphs"}


def build_parser() -> argparse.ArgumentParser:
    """train.py's parser: a flag per :class:`TrainArgs` field (our shared options from
    ``megatron_patches.options``). Absent flags stay unset (``parse_args`` records which were
    given)."""
    p = _Parser(prog="train.py", description="DP × CP × TP training with context-parallel "
                "attention (Megatron-Core models; gloo on CPU, NCCL + bf16 on GPUs).")
    for f in fields(TrainArgs):
        if f.name == "set_by_user":
            continue
        if f.metadata.get("sp"):
            option(f.name).add_to(p, use_default=False)
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        default = meta.get("default_help") or ("unset" if f.default is None else f.default)
        help_ = f"{meta.get('help', '')} (default: {default})"
        if f.name == "bf16":
            p.add_argument("--bf16", dest="bf16", action="store_true", default=argparse.SUPPRESS,
                           help=help_)
            p.add_argument("--fp32", dest="bf16", action="store_false",
                           default=argparse.SUPPRESS, help="fp32 parameters and compute")
        elif f.name in NEGATABLE:
            p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_)
            p.add_argument(NEGATABLE[f.name], dest=f.name, action="store_false",
                           default=argparse.SUPPRESS, help=f"off (see {flag})")
        elif f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_)
        else:
            extra = {"nargs": meta["nargs"]} if meta.get("nargs") else {}
            p.add_argument(flag, type=_python_type(f), default=argparse.SUPPRESS, help=help_,
                           choices=meta.get("choices"), **extra)
    for old, new in RENAMED.items():
        p.add_argument(old, dest=new[2:].replace("-", "_"), action=_Renamed,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                       choices=option(new[2:].replace("-", "_")).choices)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainArgs:
    ns = vars(build_parser().parse_args(argv))
    return TrainArgs(**ns, set_by_user=tuple(sorted(ns)))
