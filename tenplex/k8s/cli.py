"""``tenplex k8s ...``: print the ElasticJob CRD, validate ElasticJob manifests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tenplex.errors import InvalidInput


def register(sub: argparse._SubParsersAction) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes: the ElasticJob CRD and manifest validation")
    cmds = k8s.add_subparsers(dest="k8s_command", metavar="SUBCOMMAND", required=True)

    crd = cmds.add_parser("crd", help="print the ElasticJob CustomResourceDefinition as YAML")
    crd.set_defaults(func=_crd)

    validate = cmds.add_parser(
        "validate", help="check ElasticJob manifests against the CRD schema and its rules (unknown fields are errors)"
    )
    validate.add_argument("files", nargs="+", help="YAML files; multi-document files are fine")
    validate.set_defaults(func=_validate)


def _crd(args: argparse.Namespace) -> int:
    from tenplex.k8s.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from tenplex.k8s.crd import KIND, elasticjob_errors

    failed = 0
    for name in args.files:
        path = Path(name)
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidInput(f"{name}: cannot read YAML: {exc}") from exc
        jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
        if not jobs:
            raise InvalidInput(f"{name}: no {KIND} document found (kinds: {[d.get('kind') for d in docs if isinstance(d, dict)]})")
        for job in jobs:
            job_name = (job.get("metadata") or {}).get("name", "<unnamed>")
            errors = elasticjob_errors(job)
            if errors:
                failed += 1
                print(f"{name}: {KIND} {job_name}: invalid")
                for err in errors:
                    print(f"  - {err}")
            else:
                print(f"{name}: {KIND} {job_name}: valid")
    return 1 if failed else 0
