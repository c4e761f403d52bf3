"""The torchtitan key map against torchtitan 0.3.0 itself: its llama3 debug model, its optimizer container and
its checkpointer's state-dict structure (``ModelWrapper`` + ``OptimizersContainer``), on CPU in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

# torchtitan and the `clients` extra, installed by `make install` (part of `make test`)
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.optimizer import default_adamw
from torchtitan.models.llama3 import model_registry

from tenplex.core.version import Version
from tenplex.errors import InvalidConfig
from tenplex.interop.dcp import export_dcp, import_dcp
from tenplex.interop.keymap import build
from tenplex.ptc import PTC, DatasetState, Device, Region, TensorKind, build_tensor
from tenplex.ptc.dtypes import name_of_torch, torch_dtype
from tenplex.store.local import LocalStore
from tenplex.worker import restore, trainer_state

from .conftest import assert_bits_equal

N_HEADS = 16  # the debug model: dim 256, 16 heads, no GQA (heads_per_kv 1): wqkv rows interleave q, k, v per head
SEQ_LEN = 128
OPTIONS = {"n_heads": str(N_HEADS), "seq_len": str(SEQ_LEN)}
CONSUMED = DatasetState(4096, 1, 8, 72)


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, Any]:
    """torchtitan's debug llama3 with random weights, and its optimizer container after one real AdamW step."""
    torch.manual_seed(seed)
    model = model_registry("debugmodel").model.build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers.step()
    optimizers.zero_grad()
    return model, optimizers


def _state(model: torch.nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    """Tenplex names: named_parameters() and optim/<fqn>/<state>, read off torchtitan's flat optimizer keys."""
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for key, value in optimizers.state_dict().items():
        if key.startswith("state.") and isinstance(value, torch.Tensor):
            fqn, _, state = key[len("state."):].rpartition(".")
            out[f"optim/{fqn}/{state}"] = value.detach().clone()
    return out


def _ptc(state: dict[str, torch.Tensor], tp: int) -> PTC:
    """2 hosts, dp2 x tp: matrices cut by rows across tp (wqkv cut inside its head groups), the rest replicated."""
    devices = tuple(Device(i, f"h{i // tp}", {"dp": i // tp, "tp": i % tp}) for i in range(2 * tp))
    tensors = []
    for name, t in state.items():
        shape = tuple(t.shape)
        kind = TensorKind.OPTIMIZER if name.startswith("optim/") else TensorKind.PARAM
        if len(shape) == 2 and tp > 1:
            shards = [(r, tuple(d for d in range(2 * tp) if d % tp == i)) for i, r in enumerate(Region.full(shape).split(0, tp))]
        else:
            shards = [(Region.full(shape), tuple(range(2 * tp)))]
        tensors.append(build_tensor(name, shape, name_of_torch(t.dtype), kind, shards))
    return PTC({"dp": 2, "tp": tp, "pp": 1}, devices, tuple(tensors), DatasetState(4096, 1, 8, 0))


def _write(ptc: PTC, stores: dict[str, Any], state: dict[str, torch.Tensor], job: str, version: Version,
           optimizer: torch.optim.Optimizer) -> None:
    """The shards on their hosts, and rank 0's trainer-state record (hyper-parameters, data position) as a snapshot writes it."""
    for host in ptc.hosts:
        for t, s in ptc.shards_on_host(host):
            stores[host].write_shard(job, version, t.name, s.region, state[t.name][s.region.slices()].contiguous(),
                                     dtype=t.dtype, global_shape=t.shape)
    record = trainer_state.capture(step=version.step, rank=0, parallel=dict(ptc.config), optimizer=optimizer,
                                   lr_scheduler=None, dataset=CONSUMED, extra=None)
    stores["h0"].write_shard(job, version, trainer_state.record_name(0), Region.full((len(record),)),
                             torch.frombuffer(bytearray(record), dtype=torch.uint8), dtype="uint8", global_shape=(len(record),))
    for host in ptc.hosts:
        stores[host].commit(job, version)


def test_key_names_match_torchtitan() -> None:
    model, optimizers = _model_and_optimizer(0)
    ptc = _ptc(_state(model, optimizers), tp=1)
    kmap = build("torchtitan", ptc, OPTIONS)
    model_keys = set(ModelWrapper(model).state_dict())
    optim_keys = {f"optimizer.{k}" for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}
    assert {e.fqn for e in kmap.entries} == model_keys | optim_keys
    assert "layers.0.attention.qkv_linear.wq.weight" in model_keys
    assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in optim_keys
    with pytest.raises(InvalidConfig, match="needs the head size"):
        build("torchtitan", ptc, {})


def test_export_loads_into_torchtitans_checkpoint_structure(tmp_path: Path) -> None:
    model, optimizers = _model_and_optimizer(1)
    state = _state(model, optimizers)
    ptc = _ptc(state, tp=2)
    stores = {h: LocalStore(tmp_path / h) for h in ptc.hosts}
    _write(ptc, stores, state, "tt", Version(9, 1), optimizers.optimizers[0])
    ckpt = tmp_path / "ckpt"
    result = export_dcp("tt", "s9-g1", ptc, stores, ckpt, key_map="torchtitan", options=OPTIONS)
    assert result.bytes == ptc.total_bytes

    # what torchtitan's CheckpointManager.dcp_load does, into a fresh model and optimizer container
    fresh, fresh_opt = _model_and_optimizer(2)
    for g in fresh_opt.optimizers[0].param_groups:
        g["lr"] = 0.5  # to see the checkpoint's hyper-parameters arrive
    wrapper = ModelWrapper(fresh)
    sd: dict[str, Any] = {"optimizer": fresh_opt, "lr_scheduler": {"last_epoch": 0},
                          "train_state": {"step": 0, "ntokens_seen": 0}}
    sd.update(wrapper.state_dict())
    dcp.load(sd, checkpoint_id=ckpt)
    wrapper.load_state_dict(sd)
    for name, p in fresh.named_parameters():
        assert_bits_equal(p.detach(), state[name], name)
    assert_bits_equal(fresh.layers["0"].attention.qkv_linear.wqkv.weight.detach(),
                      model.layers["0"].attention.qkv_linear.wqkv.weight.detach(), "fused qkv")
    for key, value in fresh_opt.state_dict().items():
        if key.startswith("state."):
            fqn, _, st = key[len("state."):].rpartition(".")
            assert_bits_equal(value, state[f"optim/{fqn}/{st}"], key)
    assert sd["lr_scheduler"]["last_epoch"] == 9
    assert sd["train_state"] == {"step": 9, "ntokens_seen": CONSUMED.consumed_samples * SEQ_LEN}
    assert fresh_opt.optimizers[0].param_groups[0]["lr"] == optimizers.optimizers[0].param_groups[0]["lr"]


def test_import_a_checkpoint_saved_by_torchtitans_structure(tmp_path: Path) -> None:
    model, optimizers = _model_and_optimizer(3)
    state = _state(model, optimizers)
    ckpt = tmp_path / "ckpt"
    saved: dict[str, Any] = {"optimizer": optimizers, "lr_scheduler": {"last_epoch": 5},
                             "train_state": {"step": 5, "ntokens_seen": 5 * 8 * SEQ_LEN}}
    saved.update(ModelWrapper(model).state_dict())
    dcp.save(saved, checkpoint_id=ckpt)

    # into a tp2 layout: every shard read back equals the model's tensors
    sharded = _ptc(state, tp=2)
    stores = {h: LocalStore(tmp_path / "tp" / h) for h in sharded.hosts}
    result = import_dcp(ckpt, sharded, "tt", None, stores, key_map="torchtitan", options=OPTIONS)
    assert str(result.version) == "s5-g0" and result.step == 5
    for host in sharded.hosts:
        for t, s in sharded.shards_on_host(host):
            buf = torch.empty(s.region.shape, dtype=torch_dtype(t.dtype))
            stores[host].read_into("tt", "s5-g0", t.name, s.region, buf)
            assert_bits_equal(buf, state[t.name][s.region.slices()], f"{host} {t.name} {s.region}")

    # into a dp2 layout, restored by tenplex.worker into a fresh model and a torch AdamW
    replicated = _ptc(state, tp=1)
    stores = {h: LocalStore(tmp_path / "dp" / h) for h in replicated.hosts}
    import_dcp(ckpt, replicated, "tt", "s5-g0", stores, key_map="torchtitan", options=OPTIONS)
    fresh, _ = _model_and_optimizer(4)
    adamw = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    restored = restore(stores["h0"], "tt", "s5-g0", replicated, 0, fresh, adamw)
    assert restored.step == 5
    names = {id(p): n for n, p in fresh.named_parameters()}
    for p in fresh.parameters():
        assert_bits_equal(p.detach(), state[names[id(p)]], names[id(p)])
        for key, value in adamw.state[p].items():
            assert_bits_equal(value, state[f"optim/{names[id(p)]}/{key}"], f"{names[id(p)]} {key}")


def test_gqa_split_equals_torchtitans_own_save_hook() -> None:
    """torchtitan's FusedQKVLinear with grouped-query attention (2 kv heads, 3 query heads each) and a bias."""
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    n_kv, hpk, hd, dim = 2, 3, 4, 8
    qkv = FusedQKVLinear.Config(head_dim=hd, n_heads=n_kv * hpk, n_kv_heads=n_kv,
                                wqkv=Linear.Config(in_features=dim, out_features=n_kv * (hpk + 2) * hd, bias=True)).build()
    with torch.no_grad():
        for p in qkv.parameters():
            p.copy_(torch.randn_like(p))
    saved = qkv.state_dict()  # the save hook's wq/wk/wv copies
    params = dict(qkv.named_parameters())
    pre = "layers.0.attention.qkv_linear."
    state = {pre + n: p.detach() for n, p in params.items()}
    state["layers.0.attention.wo.weight"] = torch.zeros(dim, n_kv * hpk * hd)
    ptc = _ptc(state, tp=1)
    kmap = build("torchtitan", ptc, {"n_heads": str(n_kv * hpk)})
    entries = kmap.by_fqn()
    assert {k for k in entries if k.startswith(pre)} == {pre + k for k in saved}
    for key, want in saved.items():
        e = entries[pre + key]
        got = torch.empty(e.shape)
        for p in e.pieces:
            got[p.target.slices()] = state[p.tensor][p.source.slices()]
        assert_bits_equal(got, want, key)
