"""The Megatron provider against megatron-core 0.19.2 itself, piece for piece.

``megatron_core_worker.py`` builds each case's ``GPTModel`` (local layer spec)
on real gloo processes and reports every rank's ``sharded_state_dict()``
(ShardedTensor key, global shape, global offset, local shape, replica id) and
its distributed optimizer's flat ranges (``_build_gbuf_range_map`` of the DDP
buffer). Here both sides become *holder maps*: for every element of every
global tensor, the set of ranks holding it (a bit mask). A piece is a maximal
set of elements of one tensor with the same holders; the provider's PTC
(``naming="megatron-core"``) must give exactly megatron-core's pieces, for
parameters and for the optimizer state:

* ZeRO 1: the optimizer state of a rank is the flat range of each local
  parameter its dp rank owns in megatron-core's buffer;
* ZeRO 0: megatron-core's (non-distributed) optimizer keeps the state of every
  local parameter whole, so the optimizer pieces are the parameter pieces.

Checkpoint keys are mapped to tensor names with
:func:`tensor_name_from_core_key`, which this also checks. The replica ids are
checked for consistency: the ranks holding one ShardedTensor region are the
PTC shard's devices, and exactly one of them is megatron-core's main replica.

The cases cover (tp, pp, dp) combinations on 4 and 8 ranks, gated MLP (SwiGLU)
on and off, grouped-query attention on and off, tied embeddings across
pipeline stages, RMSNorm without biases and rotary positions, uneven stages,
several DDP buckets, and Megatron-LM's padded vocabulary with core names.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tenplex.ptc import PTC, ParallelConfig, TensorKind
from tenplex.ptc.megatron import (
    GPTSpec,
    core_checkpoint_key,
    megatron_gpt_ptc,
    tensor_name_from_core_key,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("megatron_core_worker.py")
MEGATRON_CORE = Path(os.environ.get("TENPLEX_MEGATRON_CORE", REPO / ".tools" / "megatron-core"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("megatron-core"),  # one worker runs the module fixture (one launch) for all cases
    pytest.mark.timeout(900),  # the launch takes 30-40 s alone on 2 cores; generous for a loaded machine
    pytest.mark.skipif(
        not (MEGATRON_CORE / "megatron" / "core" / "__init__.py").is_file(),
        reason=f"megatron-core is not unpacked in {MEGATRON_CORE} (make megatron-core)",
    ),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton, which megatron-core imports, is not installed (the `clients` extra: make install)"),
]

# Tiny models whose parameters are mostly not multiples of 64 elements, so the
# buffer's alignment padding moves the dp cuts. vocab 36 divides by tp 1, 2, 4.
BASE = {"num_layers": 2, "hidden": 8, "heads": 4, "vocab": 36, "ffn_hidden": 12, "seq_len": 5}
MODELS: dict[str, dict[str, Any]] = {
    "mha": BASE,
    "gated": {**BASE, "gated_mlp": True},
    "gqa": {**BASE, "kv_heads": 2},
    "gated-gqa": {**BASE, "gated_mlp": True, "kv_heads": 2},
    # Llama-like: SwiGLU, GQA, RMSNorm, no biases, rotary positions
    "llama": {**BASE, "gated_mlp": True, "kv_heads": 2, "normalization": "RMSNorm", "bias": False, "seq_len": 0},
    "tied-gated-gqa": {**BASE, "gated_mlp": True, "kv_heads": 2, "tied_embeddings": True},
    # the first stage's buffer cut into buckets of about 300 elements
    "buckets": {**BASE, "gated_mlp": True, "overlap_grad_reduce": True, "ddp_bucket_size": 300},
    "tied-buckets": {**BASE, "tied_embeddings": True, "overlap_grad_reduce": True, "ddp_bucket_size": 200},
    # Megatron-LM's script: core names, vocabulary padded to a multiple of 4 * tp
    "padded": {**BASE, "vocab": 30, "pad_vocab": True, "make_vocab_size_divisible_by": 4},
    "uneven": {**BASE, "num_layers": 3, "gated_mlp": True, "kv_heads": 2},
}
# (dp, tp, pp, layers_per_stage) -> models
PARALLEL: dict[tuple[int, int, int, tuple[int, ...] | None], tuple[str, ...]] = {
    (2, 2, 1, None): ("mha", "gated", "gqa", "gated-gqa", "llama", "tied-gated-gqa", "buckets", "padded"),
    (2, 1, 2, None): ("mha", "gated", "gqa", "gated-gqa", "llama", "tied-gated-gqa", "buckets", "tied-buckets"),
    (1, 2, 2, None): ("mha", "gated-gqa", "llama", "tied-gated-gqa", "padded"),
    (4, 1, 1, None): ("mha", "gated-gqa", "llama", "buckets", "tied-buckets"),
    (1, 4, 1, None): ("mha", "gated"),
    (2, 1, 2, (1, 2)): ("uneven",),
    (2, 2, 2, None): ("mha", "gated-gqa", "llama", "tied-gated-gqa", "buckets", "padded"),
    (8, 1, 1, None): ("gated-gqa",),
    (4, 2, 1, None): ("tied-gated-gqa", "buckets"),
}


def _case_id(dp: int, tp: int, pp: int, lps: tuple[int, ...] | None, model: str) -> str:
    return f"dp{dp}-tp{tp}-pp{pp}{'-' + '+'.join(map(str, lps)) if lps else ''}-{model}"


def _spec(model: str) -> GPTSpec:
    return GPTSpec(**{"naming": "megatron-core", **MODELS[model]})


def _vocab_rows(model: dict[str, Any], tp: int) -> int:
    """What Megatron-LM's script (or a core user) passes to GPTModel as vocab_size (written from it)."""
    if not model.get("pad_vocab"):
        return model["vocab"]
    multiple = model.get("make_vocab_size_divisible_by", 128) * tp
    return -(-model["vocab"] // multiple) * multiple


CASES: dict[str, tuple[ParallelConfig, str]] = {
    _case_id(dp, tp, pp, lps, m): (ParallelConfig(dp=dp, tp=tp, pp=pp, layers_per_stage=lps), m)
    for (dp, tp, pp, lps), models in PARALLEL.items()
    for m in models
}


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every case on megatron-core: results[case][rank]."""
    tmp = tmp_path_factory.mktemp("megatron_core")
    worlds: dict[str, dict[str, Any]] = {}
    for case_id, (par, model) in CASES.items():
        worlds.setdefault(str(par.world_size), {})[case_id] = {
            "tp": par.tp,
            "pp": par.pp,
            "layers_per_stage": list(par.layers_per_stage) if par.layers_per_stage else None,
            "vocab_rows": _vocab_rows(MODELS[model], par.tp),
            "model": MODELS[model],
        }
    (tmp / "spec.json").write_text(json.dumps({"worlds": worlds}))
    env = {**os.environ, "TENPLEX_MEGATRON_CORE": str(MEGATRON_CORE), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    # One launch at a time on this machine: megatron-core's process groups leave ~1,500 gloo threads in each
    # of the 4 ranks, and two launches at once on 2 cores took 14 min instead of 40 s (a CI run where both
    # xdist workers started this module's fixture at once).
    with open(Path(tempfile.gettempdir()) / "tenplex-megatron-core-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(tmp / "spec.json"), str(tmp)],
            env=env, capture_output=True, text=True, timeout=840, check=False,
        )
    errors = "\n".join(p.read_text() for p in sorted(tmp.glob("*.err")))
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\n{errors}"
    print(f"megatron-core: {len(CASES)} cases in {time.perf_counter() - started:.1f} s")
    out: dict[str, list[dict[str, Any]]] = {}
    for world, cases in worlds.items():
        per_rank = [json.loads((tmp / f"w{world}-rank{r}.json").read_text()) for r in range(int(world))]
        for case_id in cases:
            out[case_id] = [results[case_id] for results in per_rank]
    return out


# -- holder maps ---------------------------------------------------------------------

Holders = dict[str, np.ndarray]
"""tensor name -> int64 array of the tensor's shape: bit r set where rank r holds the element."""


def _slices(offset: list[int], shape: list[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def core_holders(ranks: list[dict[str, Any]]) -> tuple[Holders, Holders, dict[str, tuple[int, ...]]]:
    """(parameter holders, optimizer-state holders, global shapes) from megatron-core's report."""
    params: Holders = {}
    shapes: dict[str, tuple[int, ...]] = {}
    replicas: dict[tuple[str, tuple[int, ...]], list[tuple[int, tuple[int, ...]]]] = {}
    local: list[dict[str, list[tuple[str, tuple[slice, ...]]]]] = []  # per rank: param -> (tensor, region) in local order
    for rank, report in enumerate(ranks):
        boxes: dict[str, list[tuple[str, tuple[slice, ...]]]] = {}
        for sh in report["sharded"]:
            k = sh["prepend_axis_num"]
            assert k in (0, 1)
            layer = sh["global_offset"][0] if k else None
            name = tensor_name_from_core_key(sh["key"], layer)
            assert core_checkpoint_key(name) == (sh["key"], layer)
            shape = tuple(sh["global_shape"][k:])
            assert shapes.setdefault(name, shape) == shape, name
            region = _slices(sh["global_offset"][k:], sh["local_shape"])  # the local shape has no layer axis
            params.setdefault(name, np.zeros(shape, dtype=np.int64))[region] |= 1 << rank
            boxes.setdefault(sh["name"], []).append((name, region))
            replicas.setdefault((sh["key"], tuple(sh["global_offset"])), []).append((rank, tuple(sh["replica_id"])))
        local.append(boxes)
    for (key, offset), holders in replicas.items():
        ids = [rid for _, rid in holders]
        assert len(set(ids)) == len(ids), f"{key} at {offset}: replica ids repeat: {holders}"
        assert sum(1 for rid in ids if not any(rid)) == 1, f"{key} at {offset}: not one main replica: {holders}"

    optim: Holders = {name: np.zeros_like(a) for name, a in params.items()}
    for rank, report in enumerate(ranks):
        opt = report["optimizer"]
        for pname, shape in opt["local_shapes"].items():
            assert sum(_numel_of(r) for _, r in local[rank][pname]) == int(np.prod(shape)), pname
        for own in opt["owned"]:
            pieces = local[rank][own["name"]]
            (name,) = {n for n, _ in pieces}
            ids = np.concatenate([np.arange(optim[name].size).reshape(optim[name].shape)[r].ravel() for _, r in pieces])
            optim[name].reshape(-1)[ids[own["start"]:own["end"]]] |= 1 << rank
    return params, optim, shapes


def _numel_of(region: tuple[slice, ...]) -> int:
    return int(np.prod([s.stop - s.start for s in region]))


def ptc_holders(ptc: PTC) -> tuple[Holders, Holders, dict[str, tuple[int, ...]]]:
    params: Holders = {}
    optim: Holders = {}
    for t in ptc.tensors:
        if t.kind is TensorKind.OPTIMIZER and not t.name.endswith("/exp_avg"):
            continue  # master and exp_avg_sq are sharded like exp_avg (test_ptc_megatron checks it)
        name = t.name.removeprefix("optim/").removesuffix("/exp_avg")
        target = optim if t.kind is TensorKind.OPTIMIZER else params
        holders = target.setdefault(name, np.zeros(t.shape, dtype=np.int64))
        for shard in t.shards:
            for d in shard.devices:
                holders[shard.region.slices()] |= 1 << d
    return params, optim, {t.name: t.shape for t in ptc.tensors if t.kind is TensorKind.PARAM}


def pieces(holders: Holders) -> dict[tuple[str, int], bytes]:
    """(tensor, holder mask) -> the flat ids of its elements (as bytes, to compare)."""
    out = {}
    for name, masks in holders.items():
        flat = masks.reshape(-1)
        for mask in np.unique(flat):
            out[(name, int(mask))] = np.flatnonzero(flat == mask).tobytes()
    return out


def differing(core: Holders, ours: Holders) -> tuple[int, int]:
    """(pieces of megatron-core not in the PTC, pieces in all)."""
    a, b = pieces(core), pieces(ours)
    return sum(1 for k, v in a.items() if b.get(k) != v), len(a)


@pytest.mark.parametrize("case_id", list(CASES))
@pytest.mark.parametrize("zero", [0, 1])
def test_provider_matches_megatron_core(core: dict[str, list[dict[str, Any]]], case_id: str, zero: int) -> None:
    par, model = CASES[case_id]
    par = ParallelConfig(dp=par.dp, tp=par.tp, pp=par.pp, zero=zero, layers_per_stage=par.layers_per_stage)
    ranks = core[case_id]
    # megatron-core's rank order (tp fastest, then dp, then pp) is the PTC's device order
    assert [r["coords"] for r in ranks] == [par.coords(rank) for rank in range(par.world_size)]
    core_params, core_optim, core_shapes = core_holders(ranks)
    ptc = megatron_gpt_ptc(_spec(model), par, gpus_per_node=par.world_size, precision="bf16")
    params, optim, shapes = ptc_holders(ptc)

    assert shapes == core_shapes
    assert differing(core_params, params) == (0, len(pieces(core_params)))
    want_optim = core_optim if zero else core_params
    bad, total = differing(want_optim, optim)
    assert bad == 0, f"{bad} of {total} optimizer pieces differ from megatron-core"
    for name, masks in want_optim.items():
        assert np.array_equal(optim[name], masks), name
