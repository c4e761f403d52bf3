"""An exported version loads with plain ``dcp.load`` into DTensors of another sharding on 2 gloo processes."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tenplex.interop.dcp import export_dcp
from tenplex.sockets import free_port

from .conftest import JOB, RECORDED, VERSION, Cluster, bits, random_state, source_ptc, write_version

# the load layout: what the stores cut by rows is cut by columns here, and the other way round; uneven splits
PLACEMENTS = {
    "layers.0.w": "shard1",
    "emb.weight": "shard0",
    "norm.weight": "shard0",
    "zero.w": "shard1",
    "optim/layers.0.w/exp_avg": "replicate",
    "optim/layers.0.w/step": "replicate",
}


def _load_rank(rank: int, world: int, port: int, ckpt: str, expected_file: str, out: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        expected: dict[str, torch.Tensor] = torch.load(expected_file, weights_only=True)
        mesh = init_device_mesh("cpu", (world,))
        kinds = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
        sd: dict[str, Any] = {
            name: distribute_tensor(torch.zeros(t.shape, dtype=t.dtype), mesh, [kinds[PLACEMENTS[name]]])
            for name, t in expected.items()
        }
        sd["tenplex"] = ""
        dcp.load(sd, checkpoint_id=ckpt)
        bad = []
        for name, want in expected.items():
            dt = sd[name]
            shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
            region = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            local = dt.to_local()
            if local.dtype != want.dtype or not torch.equal(bits(local), bits(want[region] if region else want)):
                bad.append(name)
        out.put((rank, bad, sd["tenplex"]))
    except BaseException as exc:
        out.put((rank, [repr(exc)], ""))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_export_loads_into_dtensors_of_another_layout(cluster: Cluster, tmp_path: Path) -> None:
    ptc = source_ptc()
    state = random_state(ptc, seed=3)
    write_version(ptc, cluster.stores(), state, JOB, VERSION, record_dataset=RECORDED)
    ckpt = tmp_path / "ckpt"
    export_dcp(JOB, VERSION, ptc, cluster.stores(), ckpt)
    expected = tmp_path / "expected.pt"
    torch.save(state, expected)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_load_rank, args=(r, 2, port, str(ckpt), str(expected), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, bad, record in results:
        assert bad == [], f"rank {rank}: {bad}"
        assert '"consumed_samples": 112' in record
