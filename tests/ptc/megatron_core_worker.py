"""What megatron-core itself lays out, on real gloo processes (run by test_ptc_megatron_core.py).

Usage: ``python megatron_core_worker.py SPEC.json OUT_DIR`` with
``TENPLEX_MEGATRON_CORE`` (the directory holding the unpacked megatron-core
wheel) in the environment. SPEC.json is ``{"worlds": {"4": {CASE_ID: CASE}}}``
with ``CASE = {"tp", "pp", "model": {...}}``. The launcher imports
megatron-core once and forks one process per rank for each world in turn
(forking shares the import, a few seconds a process on a small machine);
every case of a world runs on the same processes:
``initialize_model_parallel(tp, pp)``, a ``GPTModel`` with the local (non
Transformer-Engine) layer spec, its ``sharded_state_dict()``, and a
``DistributedDataParallel`` with ``use_distributed_optimizer=True`` whose
buffer gives ``DistributedOptimizer._build_gbuf_range_map``. Each rank writes
``OUT_DIR/w{world}-rank{r}.json`` with, per case, every ShardedTensor (key,
global shape, global offset, local shape, prepended axes, replica id) and the
flat range of each parameter its dp rank owns.

Two CPU-only accommodations, both inert for what is measured:

* megatron-core imports ``triton`` without a fallback in one module on its
  import path (the MoE paged-stash kernels, GPU-only): triton is installed
  (the torchtitan extra needs it too); its kernels are never launched here.
* ``_ParamAndGradBuffer`` allocates its buffers on ``torch.cuda.current_device()``
  and GPTModel moves the tied embedding's last-stage copy to the GPU with
  ``.cuda()`` before all-reducing it; the worker points both at the CPU. The
  distributed optimizer itself needs CUDA, so only its static range
  computation is called.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tenplex.sockets import free_port


def _import_megatron() -> None:
    """Import megatron-core from the unpacked wheel (``make megatron-core``).

    Its MoE paged-stash module imports triton unconditionally; triton is installed with the
    ``clients`` extra (``make install``), whose torchtitan imports it too. On a CPU its kernels
    are never launched here.
    """
    root = Path(os.environ["TENPLEX_MEGATRON_CORE"])
    sys.path.insert(0, str(root))
    import megatron.core  # noqa: F401

    # megatron's CUDA placement stays on the CPU: the DDP buffers, and the tied embedding's last-stage copy
    # that GPTModel moves to the GPU before all-reducing it with the first stage's
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _model(case: dict[str, Any]) -> tuple[Any, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = case["model"]  # GPTSpec fields
    extra: dict[str, Any] = {}
    if case.get("layers_per_stage"):  # megatron-core sets the first and last stage; the rest split evenly
        extra["num_layers_in_first_pipeline_stage"] = case["layers_per_stage"][0]
        if case["pp"] > 2:
            extra["num_layers_in_last_pipeline_stage"] = case["layers_per_stage"][-1]
    config = TransformerConfig(
        num_layers=m["num_layers"],
        hidden_size=m["hidden"],
        num_attention_heads=m["heads"],
        num_query_groups=m.get("kv_heads"),
        ffn_hidden_size=m.get("ffn_hidden"),
        gated_linear_unit=m.get("gated_mlp", False),
        activation_func=F.silu if m.get("gated_mlp") else F.gelu,
        add_bias_linear=m.get("bias", True),
        normalization=m.get("normalization", "LayerNorm"),
        tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"],
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        **extra,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=m.get("normalization", "LayerNorm")),
        vocab_size=case["vocab_rows"],  # the vocabulary as the training script hands it to GPTModel
        max_sequence_length=max(m["seq_len"], 1),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=m.get("tied_embeddings", False),
        position_embedding_type="learned_absolute" if m["seq_len"] else "rope",
    )
    return config, model


def _sharded(model: Any) -> list[dict[str, Any]]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for name, item in model.sharded_state_dict().items():
        if isinstance(item, ShardedTensorFactory):
            built, factory = item.build(), True
        elif isinstance(item, ShardedTensor):
            built, factory = [item], False
        else:
            continue  # ShardedObject: the layers' _extra_state (no tensor data)
        for sh in built:
            out.append(
                {
                    "name": name,
                    "key": sh.key,
                    "global_shape": list(sh.global_shape),
                    "global_offset": list(sh.global_offset),
                    "local_shape": list(sh.local_shape),
                    "prepend_axis_num": sh.prepend_axis_num,
                    "replica_id": list(sh.replica_id) if isinstance(sh.replica_id, tuple) else [sh.replica_id],
                    "factory": factory,
                }
            )
    return out


def _ranges(config: Any, model: Any, m: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=m.get("overlap_grad_reduce", False),
        bucket_size=m.get("ddp_bucket_size"),
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    (buffer,) = ddp.buffers  # one dtype: one buffer
    names = {p: n.removeprefix("module.") for n, p in ddp.named_parameters()}
    (buckets,) = DistributedOptimizer._build_gbuf_range_map(buffer).values()
    owned = []
    for bucket in buckets:
        for param, ranges in bucket["param_map"].items():
            owned.append({"name": names[param], "start": ranges["param"].start, "end": ranges["param"].end})
    return {
        "owned": owned,
        "numel": buffer.numel,
        "buckets": [[b.offset, b.grad_data.numel()] for b in buffer.buckets],
        "index": {names[p]: list(v[:2]) for p, v in buffer.param_index_map.items()},
        "local_shapes": {n: list(p.shape) for p, n in names.items()},
    }


def _case(case: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(case["tp"], case["pp"], create_gloo_process_groups=False)
    try:
        config, model = _model(case)
        return {
            "coords": {
                "tp": ps.get_tensor_model_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_rank(),
                "dp": ps.get_data_parallel_rank(),
            },
            "sharded": _sharded(model),
            "optimizer": _ranges(config, model, case["model"]),
        }
    finally:
        ps.destroy_model_parallel()


def _rank(rank: int, world: int, port: int, cases: dict[str, Any], out_dir: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        results = {case_id: _case(case) for case_id, case in cases.items()}
        (out_dir / f"w{world}-rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"w{world}-rank{rank}.err").write_text(traceback.format_exc())
        raise


def main() -> int:
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    _import_megatron()
    fork = multiprocessing.get_context("fork")
    failed = []
    for world_text, cases in json.loads(spec_path.read_text())["worlds"].items():
        world, port = int(world_text), free_port()
        procs = [fork.Process(target=_rank, args=(r, world, port, cases, out_dir)) for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        failed += [f"world {world} rank {r}: exit {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
    if failed:
        print("megatron-core worker failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
