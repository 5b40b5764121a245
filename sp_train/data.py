"""train.py's data: a generated copy task (the default) and text/jsonl files.

Every dataset returns, for a training step, the **global batch's rows of one DP rank** as
:class:`Rows` ``(tokens, labels, loss_mask, cu_seqlens)``, each ``[rows, T]``, with the labels
already shifted. Sampling depends only on ``(seed, step, row)``, so a run resumed at step k
sees the batches an uninterrupted run would have seen, and the global batch is the same for
every DP size. CP sharding happens afterwards, on the global sequence.

Packing (``--packing``): ``none`` — a row is one sequence (a sample of ``T + 1`` tokens: inputs
its first ``T``, labels its last ``T``; ``cu_seqlens`` None); ``documents`` — a row holds several
documents, ``cu_seqlens[i]`` are row i's boundaries, labels are the next token *inside* each
document (a document's last token has none: ``-100``), and train.py lays a micro-batch's rows end
to end into one packed row cut by the packing plan (``megatron_patches.packing.pack_batch``), so
attention stays inside each document and positions restart per document.
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Optional

import torch

from megatron_patches.options import UsageError
from megatron_patches.packing import (PLAN_ATTRIBUTE, pack_batch, packed_seq_params,
                                      rows_cu_seqlens)
from sp_attention import plan_packing, shard_position_ids, shard_sequence
from sp_attention.caches import to_device

from .loss import IGNORE_INDEX, check_label_ids

__all__ = ["Rows", "CopyTask", "TokenFile", "build_dataset", "packed_micro_batch",
           "local_micro_batches", "host_micro_batches", "upload_micro_batches", "plan_digests",
           "check_labels", "pad_vocab",
           "dp_rows", "ENCODINGS", "PACKINGS", "load_tokenizer"]

# How a --data-path file is read: "utf-8" (text; bytes that are not UTF-8 are an error naming
# the file and line) or "bytes" (the file's raw bytes are the tokens, whatever they encode).
ENCODINGS = ("utf-8", "bytes")
# --packing: rows of several documents with their boundaries, or rows of one sequence
PACKINGS = ("documents", "none")
IGNORE = IGNORE_INDEX             # the loss's ignore index


class Rows(NamedTuple):
    """A DP rank's rows of one step's global batch (``[rows, T]`` each)."""
    tokens: torch.Tensor
    labels: torch.Tensor           # next token; IGNORE where there is none
    loss_mask: torch.Tensor        # float, 1 where the label counts
    cu_seqlens: Optional[list] = None   # packed: each row's document boundaries (0 … T)


def _doc_labels(tokens: torch.Tensor, cu: list) -> torch.Tensor:
    """Next token inside each document of the row ``tokens [T]`` (IGNORE at each document's
    last token)."""
    labels = torch.full_like(tokens, IGNORE)
    for a, b in zip(cu[:-1], cu[1:]):
        labels[a:b - 1] = tokens[a + 1:b]
    return labels


def pad_vocab(n: int, tp: int, multiple: int = 128) -> int:
    """Round the vocabulary up to a multiple of ``multiple`` that TP divides (the embedding and
    output layer split it over TP). Unlike Megatron's ``multiple × TP`` this keeps the model —
    and so the losses — the same for every TP size up to ``multiple``."""
    v = int(math.ceil(n / multiple) * multiple)
    return v if v % tp == 0 else int(math.ceil(n / (multiple * tp)) * multiple * tp)


def dp_rows(global_batch: int, dp_rank: int, dp_size: int) -> slice:
    """This DP rank's rows of the global batch (contiguous blocks, rank-major)."""
    per = global_batch // dp_size
    return slice(dp_rank * per, (dp_rank + 1) * per)


class CopyTask:
    """Random tokens, a separator, the same tokens again; loss only on the copy.

    A sample is ``x_1 … x_n, SEP, x_1 … x_n`` with ``n = T/2`` (``T + 1`` tokens). Predicting
    ``x_i`` of the copy needs the token ``T/2`` positions back: with the zigzag split over CP
    ranks every such pair lies on two different ranks, so the loss can only fall below chance
    (``ln copy_vocab``) if attention works across ranks. A model restricted to its own shard
    (``--local-attention-only``) stays at chance.

    ``packed``: a row holds several independent copy documents of random lengths (``1.5·p`` to
    ``3·p`` tokens, ``p = T/4``; mostly two per row): each is a block of ``p − 1`` random tokens
    and a separator, repeated to its length; the loss counts every token of the repeats, each the token ``p``
    back. Positions restart per document, so a model whose attention leaked into earlier
    documents would find their tokens at the same distance; and at CP the long documents lie
    on several ranks (the packing plan cuts them), so the copies need attention across ranks.
    What is left at the row's end is a document of separators without loss.
    """

    def __init__(self, seq_length: int, copy_vocab: int, seed: int, tp: int = 1,
                 vocab_size: Optional[int] = None, packed: bool = False):
        if seq_length % 2:
            raise ValueError(f"the copy task needs an even --seq-length, got {seq_length}")
        self.seq_length, self.copy_vocab, self.seed = seq_length, copy_vocab, seed
        self.packed = packed
        self.sep = copy_vocab
        self.vocab_size = pad_vocab(max(copy_vocab + 1, vocab_size or 0), tp)
        self.tokens_used = copy_vocab + 1            # ids 0 … copy_vocab (the separator)
        self.chance_loss = math.log(copy_vocab)
        self.period = max(2, seq_length // 4)
        what = (f"packed documents: {self.period - 1} random tokens of {copy_vocab}, separator, "
                "repeated to a random length" if packed else
                f"{seq_length // 2} random tokens of {copy_vocab}, separator, copy")
        self.description = f"copy task ({what}; chance loss {self.chance_loss:.3f})"

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1) -> Rows:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.packed:
            return self._packed(g, global_batch, dp_rows(global_batch, dp_rank, dp_size))
        n = self.seq_length // 2
        x = torch.randint(0, self.copy_vocab, (global_batch, n), generator=g)
        sep = torch.full((global_batch, 1), self.sep, dtype=x.dtype)
        sample = torch.cat([x, sep, x], 1)[dp_rows(global_batch, dp_rank, dp_size)]
        mask = torch.zeros(sample.shape[0], self.seq_length, dtype=torch.float32)
        mask[:, n:] = 1.0          # labels n … 2n−1 are the copied tokens
        return Rows(sample[:, :-1].contiguous(), sample[:, 1:].contiguous(), mask)

    def _packed(self, g: torch.Generator, global_batch: int, rows: slice) -> Rows:
        T, p = self.seq_length, self.period
        shortest = p + p // 2
        tokens = torch.full((global_batch, T), self.sep, dtype=torch.int64)
        mask = torch.zeros(global_batch, T, dtype=torch.float32)
        cus = []
        for r in range(global_batch):          # the whole global batch: the same at every DP
            cu = [0]
            while T - cu[-1] >= shortest:
                a = cu[-1]
                n = int(torch.randint(shortest, min(3 * p, T - a) + 1, (1,), generator=g))
                block = torch.randint(0, self.copy_vocab, (p,), generator=g)
                block[-1] = self.sep
                tokens[r, a:a + n] = block.repeat(-(-n // p))[:n]
                mask[r, a + p - 1:a + n - 1] = 1.0   # targets p … n−1: the token p back
                cu.append(a + n)
            if cu[-1] < T:
                cu.append(T)                         # the rest: separators, no loss
            cus.append(cu)
        labels = torch.stack([_doc_labels(tokens[r], cus[r]) for r in range(global_batch)])
        return Rows(tokens[rows], labels[rows], mask[rows], cus[rows])


def _not_utf8(path: str, raw: bytes, e: UnicodeDecodeError, line: Optional[int]) -> ValueError:
    if line is None:                       # a whole .txt file: the line of the bad byte
        line = raw.count(b"\n", 0, e.start) + 1
    return ValueError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); fix the "
                      "file, or pass --data-encoding bytes to train on its raw bytes")


def _read_documents(path: str, encoding: str = "utf-8") -> list:
    """The documents of a ``.txt`` (one) or ``.jsonl`` (one ``{"text": ...}`` per line) file:
    ``str`` for ``encoding="utf-8"``, the raw ``bytes`` for ``"bytes"``. Every error names the
    file and line."""
    with open(path, "rb") as f:
        raw = f.read()
    as_bytes = encoding == "bytes"
    if not path.endswith(".jsonl"):
        if as_bytes:
            return [raw]
        try:
            return [raw.decode("utf-8")]
        except UnicodeDecodeError as e:
            raise _not_utf8(path, raw, e, None) from None
    docs = []
    for i, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8", "surrogateescape" if as_bytes else "strict"))
        except UnicodeDecodeError as e:
            raise _not_utf8(path, line, e, i) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); each "
                             "line must be one object like {\"text\": \"...\"}") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise ValueError(f"{path}:{i}: each jsonl line needs a \"text\" field")
        text = str(obj["text"])
        try:        # lone surrogates (JSON "\ud800") are not text either
            data = text.encode("utf-8", "surrogateescape" if as_bytes else "strict")
        except UnicodeEncodeError:
            raise ValueError(f"{path}:{i}: \"text\" holds an unpaired surrogate escape, "
                             "which is not UTF-8 text") from None
        docs.append(data if as_bytes else text)
    return docs


def load_tokenizer(name: str):
    """The HF tokenizer ``name`` (a hub name or a directory): the local cache first; the hub
    only when it answers, so an unreachable one fails at once, in one line, instead of
    retrying for a minute on every rank."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--tokenizer-model needs transformers: pip install -e '.[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass
    if os.path.isdir(name) or not _hub_reachable():
        raise UsageError(f"--tokenizer-model {name!r}: not a tokenizer directory nor in this "
                         "machine's HF cache, and the hub is unreachable; download it where "
                         f"there is network (hf download {name}) or pass a local directory")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--tokenizer-model {name!r}: {first}") from None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the HF hub's host accepts a TCP connection (offline mode: no)."""
    import socket
    from urllib.parse import urlparse
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


class TokenFile:
    """A text (``.txt``: one document) or ``.jsonl`` (one ``{"text": …}`` per line) file,
    tokenized (UTF-8 bytes + an end-of-document token by default, or an HF tokenizer; with
    ``encoding="bytes"`` the raw bytes, valid UTF-8 or not), packed
    into one stream and cut into ``T + 1``-token samples. Each epoch visits the samples in a
    seeded random order; every rank tokenizes the whole file (meant for small and medium
    corpora; use Megatron's indexed datasets for large ones).

    ``packed``: a sample's documents (each ends with its end-of-document token; the sample's
    first and last may be cut) are its row's documents: attention stays inside them, a
    document's last token predicts nothing (Megatron's ``--eod-mask-loss``), and the sample's
    last token still predicts the next token of its document."""

    def __init__(self, path: str, seq_length: int, seed: int, tp: int = 1,
                 tokenizer_model: Optional[str] = None, encoding: str = "utf-8",
                 packed: bool = False):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r}: use one of {ENCODINGS}")
        self.seq_length, self.seed, self.packed = seq_length, seed, packed
        docs = _read_documents(path, encoding)
        if not any(docs):
            raise ValueError(f"{path} holds no text (an empty file, or only empty lines or "
                             "\"text\" fields); give a file with text")
        if tokenizer_model:
            tok = load_tokenizer(tokenizer_model)
            eos = tok.eos_token_id if tok.eos_token_id is not None else 0
            ids = [t for d in docs for t in tok.encode(d, add_special_tokens=False) + [eos]]
            n_vocab = len(tok)
        else:
            eos = 256
            ids = [t for d in docs for t in list(d if encoding == "bytes" else
                                                 d.encode("utf-8")) + [eos]]
            n_vocab = 257
        self.eod = eos
        self.vocab_size = pad_vocab(n_vocab, tp)
        self.tokens_used = n_vocab
        self.tokens = torch.tensor(ids, dtype=torch.int64)
        self.num_samples = (len(ids) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"{path} has {len(ids)} tokens, fewer than --seq-length + 1 = "
                             f"{seq_length + 1}; use a shorter --seq-length or more text")
        self.chance_loss = math.log(n_vocab)
        self.description = (f"{os.path.basename(path)} ({len(ids):,} tokens"
                            f"{' of raw bytes' if encoding == 'bytes' else ''}, "
                            f"{self.num_samples:,} samples of {seq_length}"
                            f"{', packed documents' if packed else ''})")

    def _sample_index(self, i: int) -> int:
        epoch, j = divmod(i, self.num_samples)
        if getattr(self, "_epoch", None) != epoch:   # one permutation per epoch, cached
            self._epoch, self._perm = epoch, torch.randperm(
                self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(self._perm[j])

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        rows = range(global_batch)[dp_rows(global_batch, dp_rank, dp_size)]
        T = self.seq_length
        starts = [self._sample_index(step * global_batch + r) * T for r in rows]
        sample = torch.stack([self.tokens[s:s + T + 1] for s in starts])
        tokens, labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
        mask = torch.ones(sample.shape[0], T, dtype=torch.float32)
        if not self.packed:
            return Rows(tokens, labels, mask)
        ends = tokens == self.eod
        labels = labels.masked_fill(ends, IGNORE)     # a document's last token: no target
        mask = mask.masked_fill(ends, 0.0)
        cus = [[0] + sorted(set((torch.nonzero(e).squeeze(1) + 1).tolist()) | {T})
               for e in ends]
        return Rows(tokens, labels, mask, cus)


def packed_micro_batch(rows: Rows, mb: slice, ctx, device, *, local_only: bool = False):
    """This rank's part of a packed micro-batch, the rows ``mb`` of ``rows`` laid end to end
    and cut by their packing plan over the CP context ``ctx``: ``(tokens, position_ids,
    labels, loss_mask [1, L], Megatron PackedSeqParams)``. ``local_only`` (the
    ``--local-attention-only`` baseline, whose model sees a CP group of one): the parameters
    describe this rank's own document pieces, so attention never leaves the rank."""
    cu = rows_cu_seqlens(rows.cu_seqlens[mb], rows.tokens.shape[1])
    local, params, plan = pack_batch({"tokens": rows.tokens[mb], "labels": rows.labels[mb],
                                      "loss_mask": rows.loss_mask[mb]}, cu, ctx,
                                     pad_values={"labels": IGNORE}, device=device)
    if local_only:      # the shard's document groups, its trailing padding one more
        own = plan.local_cu_seqlens(ctx.rank)
        own = own if own[-1] == plan.local_len else own + (plan.local_len,)
        # the model's CP group is this rank alone: one rank, the row in its order
        params = packed_seq_params(torch.tensor(own),
                                   plan=plan_packing(own, 1, layout="contiguous"))
    return local["tokens"], local["position_ids"], local["labels"], local["loss_mask"], params


def build_dataset(args, tp: int):
    """The dataset ``args`` asks for (``args.data_path`` None = the copy task)."""
    packed = args.packing == "documents"
    if args.data_path is None:
        return CopyTask(args.seq_length, args.copy_vocab, args.seed, tp, args.vocab_size,
                        packed)
    return TokenFile(args.data_path, args.seq_length, args.seed, tp, args.tokenizer_model,
                     args.data_encoding, packed)


def check_labels(labels: torch.Tensor, tokens_used: int) -> None:
    """Refuse label ids outside ``[0, tokens_used)`` (other than IGNORE; the model's vocabulary
    holds at least the data's ``tokens_used``, ``setup.model_vocab``) while they are on the
    host: the loss then need not read a check back from the GPU mid-step
    (``loss.linear_cross_entropy(check_labels=False)``)."""
    check_label_ids(labels, tokens_used, IGNORE)


def host_micro_batches(data, step: int, args, layout, groups, cp_ctx) -> list:
    """train.py's micro-batches of ``step`` on this rank, on the host (``args``: its
    TrainArgs): ``(tokens, position_ids, labels, loss_mask, packed_seq_params)`` per
    micro-batch, rows of its DP rank, tokens of its CP shard, their labels checked
    (:func:`check_labels`). Packed documents: a micro-batch's rows end to end, cut by its
    packing plan, with Megatron's THD parameters for the model (None otherwise). Built while
    the GPU still runs the step before; :func:`upload_micro_batches` moves them."""
    rows = data.batch(step, args.global_batch_size, groups.dp_rank, layout.dp)
    check_labels(rows.labels, data.tokens_used)
    position_ids = shard_position_ids(args.seq_length, cp_ctx).unsqueeze(0)
    out = []
    for i in range(layout.num_micro_batches):
        mb = slice(i * layout.micro_batch_size, (i + 1) * layout.micro_batch_size)
        if rows.cu_seqlens is not None:
            out.append(packed_micro_batch(rows, mb, cp_ctx, None,
                                          local_only=args.local_attention_only))
            continue
        tok, lab, msk = (shard_sequence(x[mb], cp_ctx, dim=1) for x in rows[:3])
        out.append((tok, position_ids.expand(tok.shape[0], -1), lab, msk, None))
    return out


# DP ranks × micro-batches whose packing plans the step's agreement carries (8 numbers each:
# 256 KiB at most); beyond it each layer's call check agrees on its plan itself
PLAN_AGREEMENT_LIMIT = 4096


def plan_digests(micro_batches: list, local_only: bool = False, dp: int = 1) -> Optional[list]:
    """The packing plans' digests of :func:`host_micro_batches`' packed micro-batches, which
    every rank holding the same rows must share (train.py checks it in the step's agreement,
    ``sp_train.launch.agree_step``, and tells the layers, ``call_check.note_agreed_plans``);
    None without packed documents, with ``local_only`` (each rank's own pieces) or past
    :data:`PLAN_AGREEMENT_LIMIT` (``dp`` DP ranks of these many micro-batches)."""
    plans = [getattr(mb[4], PLAN_ATTRIBUTE, None) for mb in micro_batches]
    if local_only or not plans or any(p is None for p in plans) \
            or dp * len(plans) > PLAN_AGREEMENT_LIMIT:
        return None
    return [p.digest for p in plans]


def upload_micro_batches(micro_batches: list, device) -> list:
    """:func:`host_micro_batches`' tensors on ``device`` (the packing parameters' boundaries
    stay on the host, where the attention reads them)."""
    return [tuple(to_device(x, device) for x in mb[:4]) + (mb[4],) for mb in micro_batches]


def local_micro_batches(data, step: int, args, layout, groups, cp_ctx, device):
    """:func:`host_micro_batches` on ``device``."""
    return upload_micro_batches(host_micro_batches(data, step, args, layout, groups, cp_ctx),
                                device)
