"""Rule-based layout provider for Megatron GPT models (megatron-core's ``GPTModel``).

Given the model (:class:`GPTSpec`), a :class:`ParallelConfig` and a placement,
:func:`megatron_gpt_ptc` computes the PTC of the job's state the way
megatron-core lays it out, without running it, so a new layout is known before
its workers start. It agrees piece for piece with megatron-core 0.19.2 itself
(``GPTModel`` with the local layer spec: ``sharded_state_dict()`` and the
distributed optimizer's ``_build_gbuf_range_map``), which
``tests/ptc/test_ptc_megatron_core.py`` checks on real gloo processes.

* **Names** are global and configuration independent: the parameter's name
  with the *global* layer index, and ``optim/<param>/{master,exp_avg,exp_avg_sq}``
  for the optimizer state. Two conventions (:attr:`GPTSpec.naming`):

  - ``"megatron-core"``: ``GPTModel.named_parameters()`` with the local layer
    spec: ``embedding.word_embeddings.weight``,
    ``decoder.layers.17.mlp.linear_fc1.weight``, ``decoder.final_layernorm.weight``,
    ``output_layer.weight``. (With the Transformer-Engine spec, Megatron-LM's
    default, the two layer norms of a layer are fused into ``linear_qkv`` and
    ``linear_fc1`` and named like their checkpoint keys below. The parameter
    layout is the same, but the fused norms move in the registration order and
    so in the distributed optimizer's buffer: this provider models the local
    spec, the one megatron-core runs on a CPU, where it is checked);
  - ``"megatron-lm"`` (the default, Tenplex's original short form): the same
    without the ``decoder.`` prefix (``layers.17...``, ``final_layernorm.weight``).

  megatron-core's *checkpoint* (its sharded state dict) keys differ in two
  ways: a transformer layer's parameters are one tensor stacked over layers
  (``decoder.layers.mlp.linear_fc1.weight`` of shape ``[num_layers, ...]``, the
  global layer index being the offset along the prepended axis), and the
  layer norms are keyed by the Transformer-Engine fused names
  (``input_layernorm`` -> ``self_attention.linear_qkv.layer_norm_*``,
  ``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_*``) so local and TE
  checkpoints interchange. :func:`core_checkpoint_key` and
  :func:`tensor_name_from_core_key` map between the two.
* **Vocabulary**: Megatron-LM's training script pads the vocabulary to a
  multiple of ``make_vocab_size_divisible_by * tp``; megatron-core takes the
  vocabulary size it is given (which ``tp`` must divide).
  :attr:`GPTSpec.pad_vocab` chooses (default: pad for ``megatron-lm`` naming,
  not for ``megatron-core``).
* **Tensor parallelism**: the word embedding and the output layer are
  vocab-parallel (dim 0 split); ``linear_qkv`` and ``linear_fc1`` are
  column-parallel (dim 0 split; Megatron orders QKV rows per query group, so a
  contiguous split is exact, also for GQA); ``linear_proj`` and ``linear_fc2``
  are row-parallel (dim 1 split); norms, position embeddings and the biases of
  row-parallel linears are replicated. With a gated (SwiGLU) MLP the global
  ``linear_fc1`` is ``[gate; up]`` of ``[2*ffn, hidden]`` and every tp rank
  holds its slice of the gate *and* of the up half (two regions), as
  megatron-core's swiglu sharded-tensor factory saves it.
* **Pipeline parallelism**: stage ``s`` holds the layers of
  :meth:`ParallelConfig.stage_layers`; the embeddings live on the first stage,
  the final norm and the output layer on the last. With tied embeddings and
  ``pp > 1`` the last stage keeps its own copy of the word embeddings (its
  ``output_layer.weight``, whose gradient is all-reduced with the first
  stage's), so the one global tensor ``embedding.word_embeddings.weight`` is
  held by devices of both stages.
* **ZeRO**: stage 0 replicates the optimizer state like its parameter. Stages
  1 and 2 (megatron-core's distributed optimizer) lay the parameters of each
  (pipeline stage, tp rank) model chunk out in one flat buffer; data-parallel
  rank ``r`` owns the ``r``-th contiguous ``1/dp`` of every bucket of it,
  cutting across parameter boundaries, and keeps the optimizer state only for
  that range. Stage 3 partitions the parameters the same way (a Tenplex
  layout: megatron-core's own FSDP is not modelled).

**Buffer layout** (``DistributedOptimizer._compute_per_buffer_param_layout``;
it decides where the dp cuts fall): the chunk's parameters in *reverse*
registration order (the order backward produces their gradients), each local
tensor-parallel shard flattened row-major (the gated ``linear_fc1``: gate slice,
then up slice) and starting at a multiple of 64 elements. Registration order
is: word embeddings, position embeddings, then per layer ``input_layernorm``,
``self_attention.linear_proj``, ``self_attention.linear_qkv``,
``pre_mlp_layernorm``, ``mlp.linear_fc1``, ``mlp.linear_fc2`` (weight before
bias), then the final norm and ``output_layer.weight`` (tied and ``pp > 1``:
the last stage's word-embedding copy). A bucket closes when it reaches the
DDP bucket size (only with ``overlap_grad_reduce``, only on the first pipeline
stage; :attr:`GPTSpec.ddp_bucket_size`), and the tied word embedding of a
``pp > 1`` job always sits in a bucket of its own. Every bucket is padded to a
multiple of ``lcm(dp, 128)``.

Where a parameter has several copies in different buffers (the tied word
embeddings on the first and last stage, whose buffer offsets differ), the
optimizer shards are the common refinement of the copies' dp partitions: each
piece is held by one device of every copy, and those copies are identical
because their gradients are all-reduced.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.model import PTC, Device, Shard, Tensor, TensorKind
from tenplex.ptc.parallel import ParallelConfig, Placement, hosts_from
from tenplex.ptc.provider import layout_provider
from tenplex.ptc.region import Region, flat_range_boxes

log = logging.getLogger(__name__)

PRECISIONS: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Precision name -> dtype of the model parameters (optimizer state is always float32)."""

NAMINGS = ("megatron-lm", "megatron-core")
"""Tensor-name conventions (see the module docstring)."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

PARAM_ALIGN = 64
"""Every parameter starts at a multiple of this many elements of the distributed-optimizer buffer."""

BUCKET_ALIGN = 128
"""Every bucket is padded to a multiple of ``lcm(dp, BUCKET_ALIGN)`` elements."""


@dataclass(frozen=True)
class GPTSpec:
    """A Megatron GPT model: its dimensions and the conventions that decide its layout.

    Independent of parallelism, so one spec describes an elastic job in every
    configuration (it is what a layout spec's ``model`` object holds).
    """

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
    """Biases on the linear layers (megatron-core's ``add_bias_linear``)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only)."""
    naming: str = "megatron-lm"
    """Tensor-name convention, one of :data:`NAMINGS`."""
    pad_vocab: bool | None = None
    """Pad the vocabulary like Megatron-LM's script; ``None``: pad for ``megatron-lm`` naming only."""
    overlap_grad_reduce: bool = False
    """megatron-core DDP's ``overlap_grad_reduce``: only then is the first stage's buffer cut into buckets."""
    ddp_bucket_size: int | None = None
    """Elements per DDP bucket when ``overlap_grad_reduce``; ``None``: megatron-core's
    default ``max(40_000_000, 1_000_000 * dp)``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "vocab", "make_vocab_size_divisible_by"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seq_len", self.seq_len, minimum=0)
        for name in ("kv_heads", "ffn_hidden", "ddp_bucket_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.naming not in NAMINGS:
            raise InvalidConfig(f"naming must be one of {', '.join(NAMINGS)}, got {self.naming!r}")
        if self.normalization not in NORMALIZATIONS:
            raise InvalidConfig(f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}")
        if self.pad_vocab is None:  # resolved here, so the recorded spec says what was laid out
            object.__setattr__(self, "pad_vocab", self.naming == "megatron-lm")
        for name in ("tied_embeddings", "gated_mlp", "bias", "pad_vocab", "overlap_grad_reduce"):
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
        """Rows of the word embeddings and the output layer under ``tp``.

        Megatron-LM's padding rounds ``vocab`` up to a multiple of
        ``make_vocab_size_divisible_by * tp``; without ``pad_vocab`` it is ``vocab``.
        """
        _check_int("tp", tp, minimum=1)
        if not self.pad_vocab:
            return self.vocab
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
        if not self.pad_vocab and self.vocab % tp:
            problems.append(f"vocab {self.vocab} % tp {tp} = {self.vocab % tp} (not padded)")
        if problems:
            raise InvalidConfig(f"tensor parallelism tp={tp} does not divide the model: " + "; ".join(problems))

    def bucket_size(self, dp: int) -> int | None:
        """The first pipeline stage's DDP bucket size in elements (``None``: one bucket)."""
        if not self.overlap_grad_reduce:
            return None
        return self.ddp_bucket_size if self.ddp_bucket_size is not None else max(40_000_000, 1_000_000 * dp)

    def num_params(self, tp: int = 1) -> int:
        """Distinct parameter elements with the vocabulary padded for ``tp`` (a tied copy counts once)."""
        params = _module_params(self, self.padded_vocab(tp), range(self.num_layers), True, True)
        return sum(math.prod(p.shape) for p in params if not p.tied_copy)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfig(f"{name} must be an integer >= {minimum}, got {value!r}")


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
    shared_embedding: bool = False
    """The tied word embeddings of a ``pp > 1`` job: megatron-core gives each copy a bucket of its own."""
    tied_copy: bool = False
    """The last stage's copy of the tied word embeddings (the same global tensor as the first stage's)."""


def _prefixes(naming: str) -> tuple[str, str]:
    """(transformer-layer prefix, final-norm prefix) of a naming convention."""
    return ("decoder.layers.", "decoder.final_layernorm.") if naming == "megatron-core" else ("layers.", "final_layernorm.")


def _module_params(
    spec: GPTSpec, vocab: int, layers: range, first: bool, last: bool
) -> list[_Param]:
    """The parameters of one pipeline stage in registration order (``GPTModel.named_parameters()``)."""
    h, ffn = spec.hidden, spec.ffn
    layer_prefix, final_prefix = _prefixes(spec.naming)
    norm = ("weight", "bias") if spec.normalization == "LayerNorm" else ("weight",)
    shared = spec.tied_embeddings and first != last  # tied across pipeline stages
    out: list[_Param] = []
    if first:
        out.append(_Param("embedding.word_embeddings.weight", (vocab, h), _Split.DIM0, shared_embedding=shared))
        if spec.seq_len:
            out.append(_Param("embedding.position_embeddings.weight", (spec.seq_len, h), _Split.NONE))
    fc1_rows, fc1_split = (2 * ffn, _Split.GATED) if spec.gated_mlp else (ffn, _Split.DIM0)
    # (module, shape of its weight, rows of its bias, split of the weight, split of the bias)
    modules = (
        ("self_attention.linear_proj", (h, h), h, _Split.DIM1, _Split.NONE),
        ("self_attention.linear_qkv", (spec.qkv_rows, h), spec.qkv_rows, _Split.DIM0, _Split.DIM0),
    ), (
        ("mlp.linear_fc1", (fc1_rows, h), fc1_rows, fc1_split, fc1_split),
        ("mlp.linear_fc2", (h, ffn), h, _Split.DIM1, _Split.NONE),
    )
    for i in layers:
        p = f"{layer_prefix}{i}."
        for norm_name, block in zip(("input_layernorm", "pre_mlp_layernorm"), modules, strict=True):
            out.extend(_Param(f"{p}{norm_name}.{w}", (h,), _Split.NONE) for w in norm)
            for module, weight_shape, bias_rows, weight_split, bias_split in block:
                out.append(_Param(f"{p}{module}.weight", weight_shape, weight_split))
                if spec.bias:
                    out.append(_Param(f"{p}{module}.bias", (bias_rows,), bias_split))
    if last:
        out.extend(_Param(f"{final_prefix}{w}", (h,), _Split.NONE) for w in norm)
        if spec.tied_embeddings:
            if not first:  # the last stage's copy of the shared word embeddings (its output_layer.weight)
                out.append(
                    _Param("embedding.word_embeddings.weight", (vocab, h), _Split.DIM0, shared_embedding=True, tied_copy=True)
                )
        else:
            out.append(_Param("output_layer.weight", (vocab, h), _Split.DIM0))
    return out


_CORE_NORM_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_CORE_NORM_NAMES = {v: k for k, v in _CORE_NORM_KEYS.items()}
_LAYER = re.compile(r"(?:decoder\.)?layers\.(\d+)\.(.+)")


def core_checkpoint_key(name: str) -> tuple[str, int | None]:
    """megatron-core's sharded-state-dict key of parameter ``name`` (either naming), and its layer.

    A transformer layer's parameter is one slice of a tensor stacked over all
    layers: the key has no layer number, and the layer is the index along the
    prepended axis (``global_offset[0]`` of its ShardedTensor). Other
    parameters return ``None`` as layer. Optimizer tensors
    (``optim/<param>/...``) are not checkpoint keys of the model: pass the
    parameter's name.
    """
    if not isinstance(name, str):
        raise InvalidInput(f"tensor name must be a string, got {type(name).__name__}")
    match = _LAYER.fullmatch(name)
    if match:
        rest = match.group(2)
        return "decoder.layers." + _CORE_NORM_KEYS.get(rest, rest), int(match.group(1))
    if name.startswith(("embedding.", "output_layer.", "decoder.final_layernorm.")):
        return name, None
    if name.startswith("final_layernorm."):
        return "decoder." + name, None
    raise InvalidInput(f"{name!r} is not a Megatron GPT parameter name")


def tensor_name_from_core_key(key: str, layer: int | None, naming: str = "megatron-core") -> str:
    """The Tenplex tensor name (``naming`` convention) of megatron-core checkpoint ``key`` at ``layer``.

    The inverse of :func:`core_checkpoint_key`: ``layer`` is the index along
    the stacked-layer axis for ``decoder.layers.*`` keys and ``None`` otherwise.
    """
    if naming not in NAMINGS:
        raise InvalidConfig(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")
    layer_prefix, final_prefix = _prefixes(naming)
    if key.startswith("decoder.layers."):
        if layer is None or isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise InvalidInput(f"checkpoint key {key!r} is stacked over layers: a layer index >= 0 is needed, got {layer!r}")
        rest = key.removeprefix("decoder.layers.")
        return f"{layer_prefix}{layer}.{_CORE_NORM_NAMES.get(rest, rest)}"
    if layer is not None:
        raise InvalidInput(f"checkpoint key {key!r} is not stacked over layers, got layer {layer!r}")
    if key.startswith("decoder.final_layernorm."):
        return final_prefix + key.removeprefix("decoder.final_layernorm.")
    if key.startswith(("embedding.", "output_layer.")):
        return key
    raise InvalidInput(f"{key!r} is not a megatron-core GPT checkpoint key")


def _local_numel(param: _Param, tp: int) -> int:
    """Elements of ``param`` in one tp rank's buffer (every split divides evenly: see check_tp)."""
    return math.prod(param.shape) // (1 if param.split is _Split.NONE else tp)


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
        size = math.prod(shape)
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
    bucket: int  # element offset of its bucket in that buffer
    part: int  # elements of that bucket each dp rank owns

    def owner(self, position: int) -> int:
        """The dp rank owning element ``position`` of the local shard."""
        return (self.offset + position - self.bucket) // self.part


def _pad(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def buffer_layout(
    numels: Sequence[int], shared_embedding: Sequence[bool], dp: int, bucket_size: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """megatron-core's distributed-optimizer buffer of one model chunk.

    ``numels`` are the local parameter sizes in registration order; returns each
    parameter's ``(start, bucket index)`` in the buffer (same order) and the
    buckets as ``(start, end)``, padding included. This is
    ``DistributedOptimizer._compute_per_buffer_param_layout``: reverse order,
    parameters aligned to :data:`PARAM_ALIGN`, a bucket closed once it holds
    ``bucket_size`` elements, a shared embedding in a bucket of its own, bucket
    ends padded to ``lcm(dp, BUCKET_ALIGN)``.
    """
    _check_int("dp", dp, minimum=1)
    if bucket_size is not None:
        _check_int("bucket_size", bucket_size, minimum=1)
    if len(numels) != len(shared_embedding):
        raise InvalidConfig(f"{len(numels)} parameter sizes but {len(shared_embedding)} shared-embedding flags")
    multiple = math.lcm(dp, BUCKET_ALIGN)
    placed: dict[int, tuple[int, int]] = {}
    buckets: list[tuple[int, int]] = []
    start = bucket_start = end = 0
    open_params = 0

    def close(at: int) -> int:
        buckets.append((bucket_start, _pad(at, multiple)))
        return buckets[-1][1]

    for i in reversed(range(len(numels))):
        start = _pad(start, PARAM_ALIGN)
        if shared_embedding[i] and open_params:
            start = bucket_start = close(start)
            open_params = 0
        end = start + numels[i]
        placed[i] = (start, len(buckets))
        open_params += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared_embedding[i]:
            start = bucket_start = close(end)
            open_params = 0
        else:
            start = end
    if open_params:
        close(end)
    return [placed[i] for i in range(len(numels))], buckets


def megatron_gpt_ptc(
    spec: GPTSpec,
    parallel: ParallelConfig,
    *,
    gpus_per_node: int = 8,
    hosts: Sequence[str] | None = None,
    precision: str = "bf16",
    dataset: DatasetState | None = None,
) -> PTC:
    """The PTC of a Megatron GPT training job in ``parallel`` on the given hosts.

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

    # Parameters in global registration order, and each one's copies in the stage buffers.
    order: list[_Param] = []
    copies: dict[str, list[_Copy]] = {}
    seen: set[str] = set()
    for s, layers in enumerate(stages):
        params = _module_params(spec, vocab, layers, s == 0, s == pp - 1)
        placed, buckets = buffer_layout(
            [_local_numel(p, tp) for p in params],
            [p.shared_embedding for p in params],
            dp,
            spec.bucket_size(dp) if s == 0 else None,  # megatron-core buckets the first stage only
        )
        for p, (offset, b) in zip(params, placed, strict=True):
            start, end = buckets[b]
            copies.setdefault(p.name, []).append(_Copy(s, offset, start, (end - start) // dp))
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
        "naming": spec.naming,
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
    for c in cps:  # every dp boundary of the copy's bucket that falls inside the local shard
        k = c.owner(0) + 1
        while c.bucket + k * c.part - c.offset < n:
            cuts.add(c.bucket + k * c.part - c.offset)
            k += 1
    bounds = sorted(cuts)
    out: list[Shard] = []
    groups = [(range(tp), pieces[0])] if len(pieces) == 1 else [(range(t, t + 1), b) for t, b in enumerate(pieces)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        owners = [(c.stage, c.owner(a)) for c in cps]
        for ts, boxes in groups:
            devs = tuple(sorted(rank(d, t, s) for s, d in owners for t in ts))
            out.extend(Shard(r, devs) for r in _local_boxes(boxes, a, b))
    return tuple(out)


@layout_provider(GPTSpec)
def megatron_gpt_layout(model: GPTSpec, parallel: ParallelConfig, placement: Placement,
                        dataset: DatasetState | None, precision: str) -> PTC:
    """The ``megatron-gpt`` layout provider (registered in Tenplex's own entry points)."""
    return megatron_gpt_ptc(model, parallel, gpus_per_node=placement.gpus_per_node, hosts=placement.hosts,
                            precision=precision, dataset=dataset)
