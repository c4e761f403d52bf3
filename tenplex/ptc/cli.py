"""``tenplex ptc ...``: build, show and validate PTC files."""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter, defaultdict

from rich.console import Console
from rich.table import Table

from tenplex.core.units import human_bytes
from tenplex.errors import InvalidConfig, InvalidInput
from tenplex.ptc.dataset import DatasetState
from tenplex.ptc.megatron import GPTSpec, megatron_gpt_ptc
from tenplex.ptc.model import PTC
from tenplex.ptc.parallel import ParallelConfig

_NAMINGS = {"megatron-lm": "megatron-lm", "lm": "megatron-lm", "megatron-core": "megatron-core", "core": "megatron-core"}
"""--naming values (with their short forms) -> GPTSpec.naming."""


def register(sub: argparse._SubParsersAction) -> None:
    ptc = sub.add_parser("ptc", help="build, show and validate parallelizable tensor collections")
    cmds = ptc.add_subparsers(dest="ptc_command", metavar="SUBCOMMAND", required=True)

    show = cmds.add_parser("show", help="print a readable summary of a PTC file")
    show.add_argument("file", help="PTC JSON file")
    show.add_argument("--tensors", type=int, default=40, help="how many tensors to list (default 40; 0 for all)")
    show.set_defaults(func=_show)

    validate = cmds.add_parser("validate", help="check a PTC file; exit 0 if valid, 1 with the reason if not")
    validate.add_argument("file", help="PTC JSON file")
    validate.set_defaults(func=_validate)

    gpt = cmds.add_parser(
        "megatron-gpt",
        help="write the PTC of a Megatron (megatron-core GPTModel) GPT job",
        description="Compute the layout of a Megatron GPT training job (parameters and optimizer state, as "
        "megatron-core 0.19 lays them out) for a parallel configuration and write it as PTC JSON.",
    )
    model = gpt.add_argument_group("model")
    model.add_argument("--layers", type=int, required=True, help="transformer layers")
    model.add_argument("--hidden", type=int, required=True, help="hidden size")
    model.add_argument("--heads", type=int, required=True, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="query groups for grouped-query attention (default: heads)")
    model.add_argument("--ffn-hidden", type=int, help="MLP width (default: 4 x hidden)")
    model.add_argument("--vocab", type=int, required=True, help="vocabulary size before padding")
    model.add_argument("--tied", action="store_true", help="tie the output layer to the word embeddings")
    model.add_argument("--gated", action="store_true", help="gated (SwiGLU) MLP: fc1 holds gate and up")
    model.add_argument("--seq-len", type=int, default=2048, help="learned position embeddings (0: none, rotary)")
    model.add_argument("--no-bias", action="store_true", help="linear layers without biases")
    model.add_argument("--norm", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="normalization: LayerNorm (weight and bias, default) or RMSNorm (weight)")
    conv = gpt.add_argument_group("conventions")
    conv.add_argument("--naming", default="megatron-lm", choices=list(_NAMINGS),
                      help="tensor names: megatron-lm (layers.N..., default) or megatron-core/core "
                      "(decoder.layers.N..., GPTModel's own names)")
    conv.add_argument("--pad-vocab", action=argparse.BooleanOptionalAction, default=None,
                      help="pad the vocabulary to a multiple of --vocab-divisible-by x tp like Megatron-LM's script "
                      "(default: pad for megatron-lm naming, not for megatron-core)")
    conv.add_argument("--vocab-divisible-by", type=int, default=128,
                      help="Megatron-LM's --make-vocab-size-divisible-by (default 128)")
    conv.add_argument("--overlap-grad-reduce", action="store_true",
                      help="megatron-core DDP overlaps the gradient reduction: the first stage's "
                      "distributed-optimizer buffer is cut into buckets")
    conv.add_argument("--ddp-bucket-size", type=int,
                      help="elements per DDP bucket with --overlap-grad-reduce (default max(40M, 1M x dp))")
    par = gpt.add_argument_group("parallelism and placement")
    par.add_argument("--dp", type=int, required=True, help="data-parallel degree")
    par.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    par.add_argument("--pp", type=int, required=True, help="pipeline stages")
    par.add_argument("--layers-per-stage", help="explicit pipeline split, e.g. 3,3,2 (default: even)")
    par.add_argument("--zero", type=int, default=0, choices=range(4), help="ZeRO stage 0-3 (default 0)")
    par.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per host (default 8)")
    par.add_argument("--hosts", help="comma-separated host names in rank order (default node-0, node-1, ...)")
    par.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="default bf16")
    data = gpt.add_argument_group("dataset position (optional; all three or none)")
    data.add_argument("--samples", type=int, help="samples in the dataset")
    data.add_argument("--global-batch", type=int, help="global batch size")
    data.add_argument("--seed", type=int, help="seed of the sample order")
    data.add_argument("--consumed", type=int, default=0, help="samples consumed so far (default 0)")
    gpt.add_argument("-o", "--output", required=True, help="PTC JSON file to write")
    gpt.set_defaults(func=_megatron_gpt)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidConfig(f"{what} must be comma-separated integers, got {text!r}") from None


def _megatron_gpt(args: argparse.Namespace) -> int:
    spec = GPTSpec(
        num_layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        kv_heads=args.kv_heads,
        ffn_hidden=args.ffn_hidden,
        tied_embeddings=args.tied,
        gated_mlp=args.gated,
        seq_len=args.seq_len,
        bias=not args.no_bias,
        normalization=args.norm,
        naming=_NAMINGS[args.naming],
        pad_vocab=args.pad_vocab,
        make_vocab_size_divisible_by=args.vocab_divisible_by,
        overlap_grad_reduce=args.overlap_grad_reduce,
        ddp_bucket_size=args.ddp_bucket_size,
    )
    parallel = ParallelConfig(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        zero=args.zero,
        layers_per_stage=_int_list(args.layers_per_stage, "--layers-per-stage") if args.layers_per_stage else None,
    )
    data_args = {"--samples": args.samples, "--global-batch": args.global_batch, "--seed": args.seed}
    given = [k for k, v in data_args.items() if v is not None]
    if given and len(given) != len(data_args):
        missing = [k for k in data_args if k not in given]
        raise InvalidConfig(f"the dataset needs --samples, --global-batch and --seed; {', '.join(missing)} missing")
    dataset = (
        DatasetState(args.samples, args.seed, args.global_batch, args.consumed) if given else None
    )
    hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else None
    started = time.perf_counter()
    ptc = megatron_gpt_ptc(
        spec, parallel, gpus_per_node=args.gpus_per_node, hosts=hosts, precision=args.precision, dataset=dataset
    )
    elapsed = time.perf_counter() - started
    try:
        ptc.save(args.output)
    except OSError as exc:
        raise InvalidInput(f"cannot write {args.output!r}: {exc.strerror}") from None
    per_device = ptc.bytes_per_device().values()
    print(
        f"{args.output}: megatron-gpt {parallel.describe()} {args.precision} {spec.naming} names, "
        f"vocab {ptc.config['padded_vocab']}, {len(ptc.tensors)} tensors, "
        f"{sum(len(t.shards) for t in ptc.tensors)} shards, {len(ptc.devices)} devices on {len(ptc.hosts)} hosts, "
        f"{human_bytes(ptc.total_bytes)} state, {human_bytes(max(per_device))} max per device "
        f"(built in {elapsed:.2f} s)"
    )
    return 0


def _validate(args: argparse.Namespace) -> int:
    ptc = PTC.load(args.file)
    shards = sum(len(t.shards) for t in ptc.tensors)
    print(f"{args.file}: valid ({len(ptc.tensors)} tensors, {shards} shards, {len(ptc.devices)} devices on {len(ptc.hosts)} hosts)")
    return 0


def _show(args: argparse.Namespace) -> int:
    ptc = PTC.load(args.file)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)  # a file or pipe has no width; do not fold names to 80 columns
    config = ", ".join(f"{k}={v}" for k, v in ptc.config.items() if not isinstance(v, dict | list))
    console.print(f"[bold]{args.file}[/bold]  {config}")
    console.print(
        f"{len(ptc.tensors)} tensors, {sum(len(t.shards) for t in ptc.tensors)} shards, "
        f"{len(ptc.devices)} devices on {len(ptc.hosts)} hosts; logical state {human_bytes(ptc.total_bytes)}"
    )
    if ptc.dataset is not None:
        d = ptc.dataset
        console.print(
            f"dataset: {d.num_samples} samples, seed {d.seed}, global batch {d.global_batch_size}, consumed {d.consumed_samples}"
        )

    kinds: dict[str, int] = defaultdict(int)
    for t in ptc.tensors:
        kinds[t.kind.value] += t.nbytes
    console.print("by kind: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(kinds.items())))

    table = Table(title="tensors", show_lines=False)
    for col in ("name", "shape", "dtype", "kind", "shards", "replication", "bytes"):
        # the name folds (never "layers.0.…", which says nothing); the short columns keep their width
        table.add_column(
            col,
            justify="right" if col in ("shards", "replication", "bytes") else "left",
            overflow="fold",
            no_wrap=col != "name",
        )
    limit = len(ptc.tensors) if args.tensors == 0 else args.tensors
    for t in ptc.tensors[:limit]:
        reps = Counter(len(s.devices) for s in t.shards)
        rep = ",".join(f"{r}" for r in sorted(reps))
        table.add_row(t.name, "x".join(map(str, t.shape)) or "()", t.dtype, t.kind.value, str(len(t.shards)), rep, human_bytes(t.nbytes))
    console.print(table)
    if limit < len(ptc.tensors):
        console.print(f"... {len(ptc.tensors) - limit} more tensors (--tensors 0 lists all)")

    per_host = ptc.bytes_per_host()
    per_device = ptc.bytes_per_device()
    hosts = Table(title="hosts")
    for col in ("host", "devices", "device bytes (min / max)", "host store bytes"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    for h in ptc.hosts:
        devs = ptc.devices_on_host(h)
        sizes = [per_device[d.id] for d in devs]
        hosts.add_row(h, str(len(devs)), f"{human_bytes(min(sizes))} / {human_bytes(max(sizes))}", human_bytes(per_host[h]))
    console.print(hosts)
    return 0
