"""train.py's command line: Megatron-compatible argument names, model presets, and every check
that can fail *before* a process group or a model exists.

``parse_args(argv)`` returns a :class:`TrainArgs` (a dataclass whose ``__post_init__`` refuses
bad combinations with the fix in the message); ``TrainArgs.layout(world_size)`` adds the checks
that need the world size and returns the :class:`Layout` (TP, CP, DP, micro-batches). All of
this is pure Python, so every rank raises the same error before the first collective.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from sp_attention.linear import IMPLS as _LINEAR_IMPLS
from sp_attention.softmax import PRESETS as _SOFTMAX_PRESETS

from ..args import MODEL_KINDS
from .data import ENCODINGS as DATA_ENCODINGS

__all__ = ["PRESETS", "MODEL_KINDS", "TrainArgs", "Layout", "build_parser", "parse_args",
           "impls_for_kind"]


# Shapes. "tiny" learns the copy task on CPU in about a minute; the others are Llama shapes
# (1b = Llama-3.2-1B, 8b = Llama-3-8B). Linear attention needs head dim >= 32 to learn the copy
# task (DESIGN.md §8b), so its tiny shape is wider.
PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 ffn_hidden_size=256, seq_length=256),
    "tiny-linear": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                        ffn_hidden_size=512, seq_length=256),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=8192, seq_length=4096),
    "8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
               ffn_hidden_size=14336, seq_length=8192),
}
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "seq_length")

_SOFTMAX_IMPLS = ("auto",) + tuple(_SOFTMAX_PRESETS)     # auto: the library's default preset


def impls_for_kind(kind: str) -> tuple[str, ...]:
    """``--context-parallel-impl`` values a model kind accepts (hybrid: the linear layers'
    schedule; its softmax layers use their default ring)."""
    return _SOFTMAX_IMPLS if kind == "softmax" else _LINEAR_IMPLS


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


@dataclass
class TrainArgs:
    """Everything train.py needs; field names follow Megatron's ``--dashed-names``."""
    model_kind: str = "softmax"            # softmax (Llama) | linear (decay) | hybrid
    preset: str = "tiny"                   # shape preset; explicit shape flags override it
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # KV heads (GQA)
    ffn_hidden_size: Optional[int] = None
    seq_length: Optional[int] = None
    hybrid_pattern: Optional[str] = None   # L linear, S softmax, repeated; None: LLLS or LS
    slope_schedule: str = "long_range"
    tensor_model_parallel_size: int = 1
    context_parallel_size: Optional[int] = None  # None: 2 when the world size is even, else 1
    context_parallel_impl: str = "auto"
    local_attention_only: bool = False     # baseline: no attention across CP ranks (breaks CP)
    micro_batch_size: Optional[int] = None  # None: global batch / DP (no accumulation)
    global_batch_size: int = 16
    lr: float = 2e-3
    min_lr: float = 2e-4
    lr_warmup_iters: int = 10
    train_iters: int = 200
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    seed: int = 1234
    bf16: Optional[bool] = None            # None: bf16 on GPU, fp32 on CPU
    data_path: Optional[str] = None        # text / jsonl; None = the generated copy task
    tokenizer_model: Optional[str] = None  # HF tokenizer name; None = bytes
    data_encoding: str = "utf-8"           # utf-8: invalid text is an error naming file and
    #                                        line; bytes: train on the raw bytes as they are
    copy_vocab: int = 32                   # copy task: distinct random tokens
    vocab_size: Optional[int] = None       # copy task: model vocabulary (e.g. 128256 to time
    #                                        a Llama output layer); None = just enough
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: int = 0                 # 0: save only at the end and on SIGTERM
    ckpt_step: Optional[int] = None        # resume from this step's checkpoint under --load
    #                                        (default: the newest)
    no_checkpoint_checksums: bool = False  # skip the CRC-32 of every checkpoint file at save
    #                                        and its check at load (sizes are still checked)
    log_interval: int = 10
    log_dir: str = "runs"                  # log.jsonl, loss.png, tensorboard/ unless given below
    tensorboard_dir: Optional[str] = None
    log_json: Optional[str] = None         # JSON lines, one per step (rank 0)
    loss_png: Optional[str] = None
    peak_tflops: Optional[float] = None    # for MFU; None = known GPU table
    no_progress_bar: bool = False
    distributed_timeout_minutes: int = 10

    def __post_init__(self) -> None:
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"--model-kind {self.model_kind!r}: use one of {MODEL_KINDS}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: use one of {sorted(PRESETS)}")
        shape = dict(PRESETS[self.preset])
        if self.preset == "tiny" and self.model_kind != "softmax":
            shape = dict(PRESETS["tiny-linear"])  # linear layers need head dim >= 32
        for k in SHAPE_KEYS:
            if getattr(self, k) is None:
                setattr(self, k, shape[k])
        if self.num_query_groups > self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        self.log_json = self.log_json or os.path.join(self.log_dir, "log.jsonl")
        self.loss_png = self.loss_png or os.path.join(self.log_dir, "loss.png")
        self.tensorboard_dir = self.tensorboard_dir or os.path.join(self.log_dir, "tensorboard")
        self._check_model()
        self._check_training()

    def _check_model(self) -> None:
        h, heads, g = self.hidden_size, self.num_attention_heads, self.num_query_groups
        if h % heads:
            raise ValueError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                             f"{heads}; pick a head count that divides it")
        if heads % g:
            raise ValueError(f"--num-attention-heads {heads} is not divisible by "
                             f"--num-query-groups {g}; use a divisor of the head count")
        impls = impls_for_kind(self.model_kind)
        if self.context_parallel_impl not in impls:
            raise ValueError(f"--context-parallel-impl {self.context_parallel_impl!r} does not "
                             f"fit --model-kind {self.model_kind}; use one of {impls}")
        if self.hybrid_pattern is None:
            self.hybrid_pattern = "LLLS" if self.num_layers % 4 == 0 else "LS"
        pat = self.hybrid_pattern
        if not pat or set(pat) - set("LS") or self.num_layers % len(pat):
            raise ValueError(f"--hybrid-pattern {pat!r}: use letters L (linear) and S (softmax) "
                             f"whose length divides --num-layers {self.num_layers}, e.g. LLLS")

    def _check_training(self) -> None:
        for name in ("train_iters", "global_batch_size", "seq_length", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.data_path is not None and not os.path.exists(self.data_path):
            raise ValueError(f"--data-path {self.data_path!r} does not exist; give a .txt or "
                             ".jsonl file (or leave it out to train on the generated copy task)")
        resume_own = self.load is not None and self.load == self.save   # requeue-friendly
        if self.load is not None and not os.path.isdir(self.load) and not resume_own:
            raise ValueError(f"--load {self.load!r} is not a directory; point it at a --save "
                             "directory of an earlier run (or leave it out to start fresh)")
        if self.ckpt_step is not None and self.load is None:
            raise ValueError("--ckpt-step picks a checkpoint under --load: pass --load DIR too")
        if self.data_encoding not in DATA_ENCODINGS:
            raise ValueError(f"--data-encoding {self.data_encoding!r}: use one of "
                             f"{DATA_ENCODINGS}")
        if self.data_encoding == "bytes" and self.tokenizer_model:
            raise ValueError("--data-encoding bytes trains on raw bytes; a --tokenizer-model "
                             "needs text: leave one of them out")
        if self.copy_vocab < 2:
            raise ValueError("--copy-vocab must be >= 2")
        if self.save_interval < 0 or self.log_interval < 1:
            raise ValueError("--save-interval must be >= 0 and --log-interval >= 1")

    def layer_kinds(self) -> str:
        """One letter per layer: S softmax, L linear."""
        if self.model_kind == "hybrid":
            return self.hybrid_pattern * (self.num_layers // len(self.hybrid_pattern))
        return ("S" if self.model_kind == "softmax" else "L") * self.num_layers

    def model_signature(self) -> dict:
        """What a checkpoint must match to load (see checkpoint.check_compatible)."""
        keys = ("model_kind", "num_layers", "hidden_size", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size")
        return {k: getattr(self, k) for k in keys} | {"layers": self.layer_kinds()}

    def layout(self, world_size: int) -> Layout:
        """Check the parallel sizes against ``world_size``; return the layout."""
        tp = self.tensor_model_parallel_size
        cp = self.context_parallel_size
        if cp is None:
            cp = 2 if world_size % (2 * tp) == 0 else 1
        if tp < 1 or cp < 1:
            raise ValueError("--tensor-model-parallel-size and --context-parallel-size must be "
                             ">= 1")
        if world_size % (tp * cp):
            raise ValueError(f"world size {world_size} is not divisible by TP×CP = {tp}×{cp}; "
                             f"launch a multiple of {tp * cp} processes or change "
                             "--tensor-model-parallel-size / --context-parallel-size")
        if self.seq_length % (2 * cp):
            raise ValueError(f"--seq-length {self.seq_length} is not divisible by 2·CP = "
                             f"{2 * cp} (the zigzag split); use a multiple of {2 * cp}")
        for name, n in (("--num-attention-heads", self.num_attention_heads),
                        ("--num-query-groups", self.num_query_groups)):
            if n % tp:
                raise ValueError(f"{name} {n} is not divisible by TP = {tp}; pick "
                                 "--tensor-model-parallel-size dividing it")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                             f"TP = {tp}")
        dp = world_size // (tp * cp)
        mbs = self.micro_batch_size or self.global_batch_size // dp
        if mbs < 1 or self.global_batch_size % (mbs * dp):
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not divisible "
                             f"by micro-batch × DP = {mbs}×{dp}; pick a global batch that is a "
                             f"multiple of {mbs * dp}")
        return Layout(tp, cp, dp, mbs, self.global_batch_size // (mbs * dp))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description="DP × CP × TP training with context-parallel attention "
        "(Megatron-Core models; gloo on CPU, NCCL + bf16 on GPUs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool) or f.name in ("local_attention_only", "no_progress_bar"):
            p.add_argument(flag, action="store_true")
        elif f.name == "bf16":
            p.add_argument("--bf16", dest="bf16", action="store_true", default=None)
            p.add_argument("--fp32", dest="bf16", action="store_false")
        else:
            typ = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "")
                                                   .rstrip("]"), str)
            kw = {}
            if f.name == "model_kind":
                kw["choices"] = MODEL_KINDS
            if f.name == "preset":
                kw["choices"] = sorted(PRESETS)
            if f.name == "data_encoding":
                kw["choices"] = DATA_ENCODINGS
            p.add_argument(flag, type=typ, default=f.default, **kw)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainArgs:
    ns = build_parser().parse_args(argv)
    return TrainArgs(**vars(ns))
