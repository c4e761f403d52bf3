"""Rule-based layout provider for Megatron-LM style GPT models.

Given the model dimensions (:class:`GPTSpec`), a :class:`ParallelConfig` and a
placement, :func:`megatron_gpt_ptc` computes the PTC of the job's state the way
Megatron-LM (``megatron.core`` GPTModel) lays it out, without running it, so a
new layout is known before its workers start:

* **Names** are global and configuration independent: the fully qualified
  parameter name with the *global* layer index (``layers.17.mlp.linear_fc1.weight``),
  and ``optim/<param>/{master,exp_avg,exp_avg_sq}`` for the optimizer state.
* **Tensor parallelism**: the word embedding and the output layer are
  vocab-parallel (dim 0 split, vocabulary padded to a multiple of
  ``make_vocab_size_divisible_by * tp``); ``linear_qkv`` and ``linear_fc1`` are
  column-parallel (dim 0 split; Megatron orders QKV rows per query group, so a
  contiguous split is exact, also for GQA); ``linear_proj`` and ``linear_fc2``
  are row-parallel (dim 1 split); layer norms, position embeddings and the
  biases of row-parallel linears are replicated. With a gated (SwiGLU) MLP the
  global ``linear_fc1`` is ``[gate; up]`` of ``[2*ffn, hidden]`` and every tp
  rank holds its slice of the gate *and* of the up half (two regions), which is
  what keeps the global tensor the same for every tp degree.
* **Pipeline parallelism**: stage ``s`` holds the layers of
  :meth:`ParallelConfig.stage_layers`; the embeddings live on the first stage,
  the final layer norm and the output layer on the last. With tied embeddings
  and ``pp > 1`` the last stage keeps its own copy of the word embeddings (its
  gradient is all-reduced with the first stage's), so the one global tensor
  ``embedding.word_embeddings.weight`` is held by devices of both stages.
* **ZeRO**: stage 0 replicates the optimizer state like its parameter. Stages
  1 and 2 (Megatron's distributed optimizer) lay the parameters of each
  (pipeline stage, tp rank) model chunk out in one flat buffer, padded to a
  multiple of ``dp``; data-parallel rank ``r`` owns the ``r``-th contiguous
  ``1/dp`` of it, cutting across parameter boundaries, and keeps the optimizer
  state only for that range. Stage 3 partitions the parameters the same way.

**Buffer order** (documented because it decides where the dp cuts fall): the
chunk's parameters in *reverse* module order, as Megatron's DDP does so that
the gradients backward produces first (last layers) are contiguous. Module
order is: word embeddings, position embeddings, then for each layer
``input_layernorm.{weight,bias}``, ``self_attention.linear_qkv.{weight,bias}``,
``self_attention.linear_proj.{weight,bias}``, ``pre_mlp_layernorm.{weight,bias}``,
``mlp.linear_fc1.{weight,bias}``, ``mlp.linear_fc2.{weight,bias}``, then
``final_layernorm.{weight,bias}`` and ``output_layer.weight`` (or, tied, the
last stage's word-embedding copy). The buffer is one bucket; every local
tensor-parallel shard is flattened row-major (for the gated ``linear_fc1``: the
gate slice, then the up slice, as Megatron keeps them locally).

Where a parameter has several copies in different buffers (the tied word
embeddings on the first and last stage, whose buffer offsets differ), the
optimizer shards are the common refinement of the copies' dp partitions: each
piece is held by one device of every copy, and those copies are identical
because their gradients are all-reduced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from tenplex.errors import InvalidConfig
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC, Device, Shard, Tensor, TensorKind
from tenplex.ptc.parallel import ParallelConfig, hosts_from
from tenplex.ptc.region import Region, flat_range_boxes

log = logging.getLogger(__name__)

PRECISIONS: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Precision name -> dtype of the model parameters (optimizer state is always float32)."""


@dataclass(frozen=True)
class GPTSpec:
    """The dimensions of a Megatron-style GPT model (independent of parallelism)."""

    num_layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    """Query groups for grouped-query attention; ``None`` means ``heads`` (plain multi-head)."""
    ffn_hidden: int | None = None
    """MLP width; ``None`` means ``4 * hidden``."""
    tied_embeddings: bool = False
    gated_mlp: bool = False
    """SwiGLU: ``linear_fc1`` is ``[2*ffn, hidden]`` (gate rows, then up rows)."""
    seq_len: int = 2048
    """Rows of the learned position embeddings; 0 = none (rotary)."""
    make_vocab_size_divisible_by: int = 128
    bias: bool = True
    """Biases on the linear layers (layer norms always have weight and bias)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "vocab", "make_vocab_size_divisible_by"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seq_len", self.seq_len, minimum=0)
        for name in ("kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in ("tied_embeddings", "gated_mlp", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfig(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.hidden % self.heads:
            raise InvalidConfig(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.num_kv_heads > self.heads or self.heads % self.num_kv_heads:
            raise InvalidConfig(
                f"heads {self.heads} must be a multiple of kv_heads {self.num_kv_heads} (query groups)"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.num_kv_heads) * self.head_dim

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padding: round ``vocab`` up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        _check_int("tp", tp, minimum=1)
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """The tensor-parallel constraints, with the values in the message."""
        problems = []
        if self.heads % tp:
            problems.append(f"heads {self.heads} % tp {tp} = {self.heads % tp}")
        if self.num_kv_heads % tp:
            problems.append(f"kv_heads {self.num_kv_heads} % tp {tp} = {self.num_kv_heads % tp}")
        if self.ffn % tp:
            problems.append(f"ffn_hidden {self.ffn} % tp {tp} = {self.ffn % tp}")
        if problems:
            raise InvalidConfig(f"tensor parallelism tp={tp} does not divide the model: " + "; ".join(problems))

    def num_params(self, tp: int = 1) -> int:
        """Distinct parameter elements with the vocabulary padded for ``tp`` (a tied copy counts once)."""
        params = _module_params(self, self.padded_vocab(tp), range(self.num_layers), True, True)
        return sum(_numel(p.shape) for p in params)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfig(f"{name} must be an integer >= {minimum}, got {value!r}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Split(Enum):
    """How a parameter is cut across tensor-parallel ranks."""

    NONE = "replicated"
    DIM0 = "dim0"  # column-parallel linears, vocab-parallel embeddings
    DIM1 = "dim1"  # row-parallel linears
    GATED = "gated"  # SwiGLU fc1: dim 0 split of the gate half and of the up half


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    split: _Split


def _module_params(
    spec: GPTSpec, vocab: int, layers: range, first: bool, last: bool
) -> list[_Param]:
    """The parameters of one pipeline stage in module (registration) order."""
    h, ffn = spec.hidden, spec.ffn
    out: list[_Param] = []
    if first:
        out.append(_Param("embedding.word_embeddings.weight", (vocab, h), _Split.DIM0))
        if spec.seq_len:
            out.append(_Param("embedding.position_embeddings.weight", (spec.seq_len, h), _Split.NONE))
    fc1_rows, fc1_split = (2 * ffn, _Split.GATED) if spec.gated_mlp else (ffn, _Split.DIM0)
    for i in layers:
        p = f"layers.{i}."
        out.append(_Param(p + "input_layernorm.weight", (h,), _Split.NONE))
        out.append(_Param(p + "input_layernorm.bias", (h,), _Split.NONE))
        out.append(_Param(p + "self_attention.linear_qkv.weight", (spec.qkv_rows, h), _Split.DIM0))
        if spec.bias:
            out.append(_Param(p + "self_attention.linear_qkv.bias", (spec.qkv_rows,), _Split.DIM0))
        out.append(_Param(p + "self_attention.linear_proj.weight", (h, h), _Split.DIM1))
        if spec.bias:
            out.append(_Param(p + "self_attention.linear_proj.bias", (h,), _Split.NONE))
        out.append(_Param(p + "pre_mlp_layernorm.weight", (h,), _Split.NONE))
        out.append(_Param(p + "pre_mlp_layernorm.bias", (h,), _Split.NONE))
        out.append(_Param(p + "mlp.linear_fc1.weight", (fc1_rows, h), fc1_split))
        if spec.bias:
            out.append(_Param(p + "mlp.linear_fc1.bias", (fc1_rows,), fc1_split))
        out.append(_Param(p + "mlp.linear_fc2.weight", (h, ffn), _Split.DIM1))
        if spec.bias:
            out.append(_Param(p + "mlp.linear_fc2.bias", (h,), _Split.NONE))
    if last:
        out.append(_Param("final_layernorm.weight", (h,), _Split.NONE))
        out.append(_Param("final_layernorm.bias", (h,), _Split.NONE))
        if spec.tied_embeddings:
            if not first:  # the last stage's copy of the shared word embeddings
                out.append(_Param("embedding.word_embeddings.weight", (vocab, h), _Split.DIM0))
        else:
            out.append(_Param("output_layer.weight", (vocab, h), _Split.DIM0))
    return out


def _local_numel(param: _Param, tp: int) -> int:
    """Elements of ``param`` in one tp rank's buffer (every split divides evenly: see check_tp)."""
    return _numel(param.shape) // (1 if param.split is _Split.NONE else tp)


def _tp_pieces(param: _Param, tp: int) -> list[tuple[tuple[int, int], ...]]:
    """For each tp rank, the global boxes its local shard is made of, stacked along dim 0.

    Every box is a bounds tuple; the local tensor is their concatenation along
    dim 0 (two boxes only for the gated fc1: gate slice, then up slice). A
    single entry means every tp rank holds that same (whole) tensor.
    """
    shape = param.shape
    full = tuple((0, n) for n in shape)
    if param.split is _Split.NONE or tp == 1:
        return [(full,)]  # one local shard, the whole tensor, shared by every tp rank
    if param.split is _Split.GATED:
        half = shape[0] // 2
        step = half // tp
        return [
            (((t * step, (t + 1) * step), *full[1:]), ((half + t * step, half + (t + 1) * step), *full[1:]))
            for t in range(tp)
        ]
    dim = 0 if param.split is _Split.DIM0 else 1
    step = shape[dim] // tp
    out = []
    for t in range(tp):
        bounds = list(full)
        bounds[dim] = (t * step, (t + 1) * step)
        out.append((tuple(bounds),))
    return out


def _local_boxes(pieces: Sequence[tuple[tuple[int, int], ...]], start: int, stop: int) -> list[Region]:
    """The global boxes of the flat range ``[start, stop)`` of a local shard made of ``pieces``."""
    out: list[Region] = []
    base = 0
    for box in pieces:
        shape = tuple(b - a for a, b in box)
        size = _numel(shape)
        lo, hi = max(start, base), min(stop, base + size)
        if lo < hi:
            out.extend(flat_range_boxes(shape, lo - base, hi - base, origin=[a for a, _ in box]))
        base += size
    return out


@dataclass(frozen=True, slots=True)
class _Copy:
    """One pipeline stage's copy of a parameter in that stage's flat buffers."""

    stage: int
    offset: int  # element offset of the local shard in the (stage, tp rank) buffer
    part: int  # elements each dp rank owns of that buffer


def megatron_gpt_ptc(
    spec: GPTSpec,
    parallel: ParallelConfig,
    *,
    gpus_per_node: int = 8,
    hosts: Sequence[str] | None = None,
    precision: str = "bf16",
    dataset: DatasetState | None = None,
) -> PTC:
    """The PTC of a Megatron-LM GPT training job in ``parallel`` on the given hosts.

    Raises :class:`InvalidConfig` naming the values when the model does not
    divide by the parallel degrees, the placement does not fit, the precision
    is unknown or the dataset's global batch does not divide by ``dp``.
    """
    if not isinstance(spec, GPTSpec):
        raise InvalidConfig(f"spec must be a GPTSpec, got {type(spec).__name__}")
    if not isinstance(parallel, ParallelConfig):
        raise InvalidConfig(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    if precision not in PRECISIONS:
        raise InvalidConfig(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    spec.check_tp(parallel.tp)
    stages = parallel.stage_layers(spec.num_layers)
    placement = hosts_from(list(hosts) if hosts is not None else None, parallel.world_size, gpus_per_node)
    placement.check(parallel)
    if dataset is not None:
        dataset.check_dp(parallel.dp)

    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    devices = tuple(
        Device(r, placement.host_of(r), parallel.coords(r)) for r in range(parallel.world_size)
    )
    vocab = spec.padded_vocab(tp)

    # Parameters in global module order, and each one's copies in the stage buffers.
    order: list[_Param] = []
    copies: dict[str, list[_Copy]] = {}
    seen: set[str] = set()
    for s, layers in enumerate(stages):
        params = _module_params(spec, vocab, layers, s == 0, s == pp - 1)
        local = [_local_numel(p, tp) for p in params]
        total = sum(local)
        part = -(-total // dp)  # the buffer is padded to part * dp elements
        offset = 0
        for p, n in zip(reversed(params), reversed(local), strict=True):
            copies.setdefault(p.name, []).append(_Copy(s, offset, part))
            offset += n
        order.extend(p for p in params if p.name not in seen)
        seen.update(p.name for p in params)

    param_dtype = PRECISIONS[precision]
    optim_names = ("master", "exp_avg", "exp_avg_sq") if precision != "fp32" else ("exp_avg", "exp_avg_sq")

    def rank(d: int, t: int, s: int) -> int:  # ParallelConfig.rank without its per-call checks
        return (s * dp + d) * tp + t

    tensors: list[Tensor] = []
    optim: list[Tensor] = []
    for p in order:
        cps = copies[p.name]
        pieces = _tp_pieces(p, tp)
        replicated = _replicated_shards(pieces, cps, dp, tp, rank)
        partitioned = _partitioned_shards(p, pieces, cps, tp, rank) if parallel.zero else replicated
        tensors.append(Tensor(p.name, p.shape, param_dtype, TensorKind.PARAM, partitioned if parallel.zero == 3 else replicated))
        for suffix in optim_names:
            optim.append(Tensor(f"optim/{p.name}/{suffix}", p.shape, "float32", TensorKind.OPTIMIZER, partitioned))
    config: dict[str, Any] = {
        "provider": "megatron-gpt",
        **parallel.to_json(),
        "gpus_per_node": gpus_per_node,
        "precision": precision,
        "padded_vocab": vocab,
        "model": spec.to_json(),
    }
    ptc = PTC(config=config, devices=devices, tensors=tuple(tensors + optim), dataset=dataset)
    log.debug("megatron-gpt layout %s: %d tensors, %d devices", parallel.describe(), len(ptc.tensors), len(devices))
    return ptc


def _replicated_shards(
    pieces: list[tuple[tuple[int, int], ...]], cps: list[_Copy], dp: int, tp: int, rank: Callable[[int, int, int], int]
) -> tuple[Shard, ...]:
    """Shards of a parameter held whole by every dp rank of every copy (ZeRO 0 layout)."""
    if len(pieces) == 1:  # replicated across tp: one shard, every device of the holding stages
        devs = tuple(sorted(rank(d, t, c.stage) for c in cps for d in range(dp) for t in range(tp)))
        return (Shard(Region(pieces[0][0]), devs),)
    out = []
    for t, boxes in enumerate(pieces):
        devs = tuple(sorted(rank(d, t, c.stage) for c in cps for d in range(dp)))
        out.extend(Shard(Region(b), devs) for b in boxes)
    return tuple(out)


def _partitioned_shards(
    p: _Param, pieces: list[tuple[tuple[int, int], ...]], cps: list[_Copy], tp: int, rank: Callable[[int, int, int], int]
) -> tuple[Shard, ...]:
    """Shards of a flat-partitioned (distributed optimizer / ZeRO-3) tensor.

    The local shard's flat range is cut wherever a dp boundary of any copy's
    buffer falls inside it; each resulting interval is owned by exactly one dp
    rank per copy (and per tp rank sharing the same local shard).
    """
    n = _local_numel(p, tp)
    cuts = {0, n}
    for c in cps:
        k = c.offset // c.part + 1
        while k * c.part - c.offset < n:
            cuts.add(k * c.part - c.offset)
            k += 1
    bounds = sorted(cuts)
    out: list[Shard] = []
    groups = [(range(tp), pieces[0])] if len(pieces) == 1 else [(range(t, t + 1), b) for t, b in enumerate(pieces)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        owners = [(c.stage, (c.offset + a) // c.part) for c in cps]
        for ts, boxes in groups:
            devs = tuple(sorted(rank(d, t, s) for s, d in owners for t in ts))
            out.extend(Shard(r, devs) for r in _local_boxes(boxes, a, b))
    return tuple(out)
