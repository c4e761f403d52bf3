"""The Helm chart: lint, render, validate offline against the Kubernetes schemas, and check its contracts."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tenplex.k8s import crd

from .conftest import REPO, tool

CHART = REPO / "deploy" / "helm" / "tenplex"
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("elasticjob-*.yaml"))
K8S_VERSION = "1.33.0"

FULL = [
    "--set", "scheduler.replicas=2",
    "--set", "metrics.serviceMonitor.enabled=true",
    "--set", "scheduler.watchNamespaces={ml,research}",
    "--set", "auth.token=s3cret",
    "--set", "imagePullSecrets[0].name=regcred",
]
SECURE = [
    "--set", "tls.enabled=true", "--set", "tls.secretName=tenplex-tls",
    "--set", "networkPolicy.nodeCIDRs={10.0.0.0/16,fd00::/64}", "--set", "networkPolicy.apiNamespaces={ops}",
    "--set", "networkPolicy.metricsNamespaces={monitoring}", "--set", "scheduler.watchNamespaces={ml}",
    "--set", "metrics.serviceMonitor.enabled=true", "--set", "auth.jobCredentials.existingSecret=team-keys",
]
VALUE_SETS = {"defaults": [], "full": FULL, "secure": SECURE,
              "no-store": ["--set", "store.enabled=false", "--set", "metrics.serviceMonitor.enabled=true"], "existing-secret": ["--set", "auth.existingSecret=mine", "--set", "store.fixPermissions=false",
                                                               "--set", "store.hostPort=false", "--set", "rbac.create=true"]}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys, which the API server's strict decoding rejects."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = sorted({str(k) for k in keys if keys.count(k) > 1})
        if duplicates:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def render(*values: str, crds: bool = False) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "tenplex", *values]
    if crds:
        args.append("--include-crds")
    return [d for d in yaml.load_all(helm(*args).stdout, Loader=_StrictLoader) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def test_crd_file_is_generated_from_crd_py() -> None:
    path = CHART / "crds" / "elasticjobs.tenplex.io.yaml"
    assert path.read_text() == crd.crd_yaml(), f"{path} is stale: run `tenplex k8s crd > {path.relative_to(REPO)}`"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict_is_clean(name: str) -> None:
    result = helm("lint", "--strict", str(CHART), *VALUE_SETS[name])
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_are_valid_kubernetes_objects(name: str) -> None:
    docs = render(*VALUE_SETS[name], crds=True)
    checked = []
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # not a Kubernetes type: checked against the Services in test_service_monitors_scrape_real_ports
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked.append(doc["kind"])
    expected = {"CustomResourceDefinition", "Deployment", "Service", "ServiceAccount",
                "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert expected <= set(checked)
    assert ("DaemonSet" in checked) == (name != "no-store")
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert ("rel-tenplex-auth" in secrets) == (name != "existing-secret")
    assert ("rel-tenplex-auth-keys" in secrets) == (name != "secure")  # secure names an existing key set
    assert ("NetworkPolicy" in checked) is True  # on by default


def test_service_monitors_scrape_real_ports() -> None:
    docs = render(*FULL)
    monitors = by_kind(docs, "ServiceMonitor")
    assert sorted(m["metadata"]["name"] for m in monitors) == ["rel-tenplex-scheduler", "rel-tenplex-store"]
    services = by_kind(docs, "Service")
    secret = one(docs, "Secret", "rel-tenplex-auth")
    for monitor in monitors:
        spec = monitor["spec"]
        selector = spec["selector"]["matchLabels"]
        matched = [s for s in services if selector.items() <= s["metadata"]["labels"].items()
                   and selector.items() <= s["spec"]["selector"].items()]
        assert len(matched) == 1, f"{monitor['metadata']['name']} selects {[s['metadata']['name'] for s in matched]}"
        port_names = {p["name"] for p in matched[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
            creds = endpoint["authorization"]["credentials"]
            assert creds["name"] == secret["metadata"]["name"] and creds["key"] in secret["data"]
    assert by_kind(render(), "ServiceMonitor") == []


def test_scheduler_deployment_contract() -> None:
    docs = render()
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]
    assert pod["metadata"]["labels"][crd.LABEL_ROLE] == crd.ROLE_SCHEDULER
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["args"][1:] == ["scheduler", "serve", "--backend", "kubernetes", "--host", "0.0.0.0", "--port", "8080"]
    env = {e["name"]: e for e in container["env"]}
    secret = one(docs, "Secret", "rel-tenplex-auth")
    assert env[crd.ENV_TOKEN]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "token"}
    assert env["TENPLEX_LEASE_NAME"]["value"] == crd.LEADER_LEASE
    assert env["TENPLEX_STORE_PORT"]["value"] == str(crd.STORE_PORT)
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["spec"]["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    service = one(docs, "Service", "rel-tenplex-scheduler")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_store_daemonset_contract() -> None:
    docs = render()
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]
    assert pod["metadata"]["labels"][crd.LABEL_ROLE] == crd.ROLE_STORE
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["args"] == ["store", "serve", "--root", crd.DEFAULT_STORE_ROOT, "--host", "0.0.0.0",
                                 "--port", str(crd.STORE_PORT), "--transform-concurrency", "8",
                                 "--transform-memory", "2Gi", "--transform-resident", "1Gi", "--transform-max-running", "2",
                                 "--upload-concurrency", "4", "--upload-memory", "512Mi", "--upload-max-running", "2",
                                 "--upload-retry-for", "900"]
    # The daemon's own parser takes what the chart passes.
    from tenplex.cli import build_parser

    args = build_parser().parse_args(container["args"])
    assert (args.transform_concurrency, args.transform_memory, args.transform_resident, args.transform_max_running) \
        == (8, 2 << 30, 1 << 30, 2)
    assert (args.upload_concurrency, args.upload_memory, args.upload_max_running, args.upload_retry_for) == \
        (4, 512 << 20, 2, 900.0)
    assert not [e for e in container["env"] if e["name"].startswith("AWS_")]  # no Secret named: none
    # It relays its workers' heartbeats to the scheduler the workers are told of (the daemon checks they match).
    scheduler_env = _workload_env(one(docs, "Deployment"))
    assert _workload_env(ds)["TENPLEX_SCHEDULER_URL"]["value"] == scheduler_env["TENPLEX_ADVERTISE_URL"]["value"] == \
        "http://rel-tenplex-scheduler.tenplex.svc:8080"
    (port,) = container["ports"]
    assert port["containerPort"] == port["hostPort"] == crd.STORE_PORT
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["store"]["hostPath"] == {"path": crd.DEFAULT_STORE_ROOT, "type": "DirectoryOrCreate"}
    assert {"name": "store", "mountPath": crd.DEFAULT_STORE_ROOT} in container["volumeMounts"]
    assert {"key": crd.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["automountServiceAccountToken"] is False
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["securityContext"]["runAsNonRoot"] is True
    (init,) = spec["initContainers"]
    assert init["command"] == ["chown", "10001:10001", crd.DEFAULT_STORE_ROOT]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}

    custom = render("--set", "store.hostPath=/mnt/nvme/tenplex", "--set", "store.port=7171", "--set", "store.fixPermissions=false",
                    "--set", "store.nodeSelector.pool=gpu")
    cspec = one(custom, "DaemonSet")["spec"]["template"]["spec"]
    assert cspec["volumes"][0]["hostPath"]["path"] == "/mnt/nvme/tenplex"
    assert cspec["containers"][0]["ports"][0]["hostPort"] == 7171
    assert cspec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "gpu"}
    assert "initContainers" not in cspec
    assert "memory" not in volumes and "--memory-root" not in container["args"]  # no memory tier by default


def test_store_memory_tier_values() -> None:
    """store.memory: the daemon gets its tier flags and the node tmpfs directory (a hostPath shared with the
    worker pods, which the scheduler mounts at the same path); the daemon's own parser takes the flags."""
    docs = render("--set", "store.memory.enabled=true", "--set", "store.memory.budget=8Gi",
                  "--set", "store.memory.hostPath=/dev/shm/tp", "--set", "store.memory.root=/var/lib/tenplex/memory")
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = container["args"]
    assert args[args.index("--memory-root") + 1] == "/var/lib/tenplex/memory"
    assert args[args.index("--memory-bytes") + 1] == "8Gi"
    from tenplex.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert (parsed.memory_root, parsed.memory_bytes, parsed.evict_grace) == ("/var/lib/tenplex/memory", 8 << 30, 2.0)
    assert parsed.spill_interval == 0.0
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["memory"]["hostPath"] == {"path": "/dev/shm/tp", "type": "DirectoryOrCreate"}
    assert {"name": "memory", "mountPath": "/var/lib/tenplex/memory"} in container["volumeMounts"]
    (init,) = spec["initContainers"]
    assert init["command"][-1] == "/var/lib/tenplex/memory"  # the non-root daemon and workers own it too
    env = {e["name"]: e.get("value") for e in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["TENPLEX_STORE_MEMORY_HOST_PATH"], env["TENPLEX_STORE_MEMORY_ROOT"]) == ("/dev/shm/tp", "/var/lib/tenplex/memory")
    bad = helm("template", "rel", str(CHART), "--set", "store.memory.budget=lots", check=False)
    assert bad.returncode != 0 and "budget" in bad.stderr


def test_store_daemonset_reaches_the_persistent_tier_with_credentials_from_a_secret() -> None:
    docs = render("--set", "store.persistent.endpoint=http://minio.storage:9000", "--set", "store.persistent.region=eu-1",
                  "--set", "store.persistent.credentials.existingSecret=s3-creds",
                  "--set", "store.persistent.credentials.sessionTokenKey=token",
                  "--set", "store.extraVolumes[0].name=shared", "--set", "store.extraVolumes[0].nfs.server=nfs",
                  "--set", "store.extraVolumes[0].nfs.path=/ckpt",
                  "--set", "store.extraVolumeMounts[0].name=shared", "--set", "store.extraVolumeMounts[0].mountPath=/ckpt")
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    from tenplex.cli import build_parser

    args = build_parser().parse_args(container["args"])
    assert (args.s3_endpoint, args.s3_region) == ("http://minio.storage:9000", "eu-1")
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_SESSION_TOKEN"] == {"name": "s3-creds", "key": "token"}
    assert {"name": "shared", "mountPath": "/ckpt"} in container["volumeMounts"]
    assert {"name": "shared", "nfs": {"server": "nfs", "path": "/ckpt"}} in spec["volumes"]
    bad = helm("template", "rel", str(CHART), "--set", "store.persistent.endpoint=minio:9000", check=False)
    assert bad.returncode != 0 and "endpoint" in bad.stderr


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    return {(g, r, v, tuple(rule.get("resourceNames", ()))) for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_is_least_privilege() -> None:
    """The rendered rules, spelled out; test_k8s_rbac.py proves them against what the scheduler really calls."""
    docs = render()
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("ClusterRole", "Role")}
    assert sorted(roles) == ["rel-tenplex-jobs", "rel-tenplex-leader-election", "rel-tenplex-nodes"]
    granted = set().union(*(_rules(r) for r in roles.values()))
    expected = {("", "nodes", v, ()) for v in ("list", "watch")}
    expected |= {("tenplex.io", "elasticjobs", v, ()) for v in ("list", "watch")}
    expected |= {("tenplex.io", "elasticjobs/status", "patch", ())}
    expected |= {("", "pods", v, ()) for v in ("create", "list", "watch", "patch", "delete")}
    expected |= {("", "events", "create", ())}
    expected |= {("", "configmaps", v, ()) for v in ("create", "get", "list", "patch", "delete")}
    expected |= {("policy", "poddisruptionbudgets", "create", ())}
    expected |= {("coordination.k8s.io", "leases", "create", ())}
    expected |= {("coordination.k8s.io", "leases", v, (crd.LEADER_LEASE,)) for v in ("get", "update")}
    assert granted == expected
    assert not any("*" in str(r["rules"]) for r in roles.values())
    assert roles["rel-tenplex-leader-election"]["kind"] == "Role"

    namespaced = render("--set", "scheduler.watchNamespaces={ml,research}")
    job_roles = [d for d in by_kind(namespaced, "Role") if d["metadata"]["name"] == "rel-tenplex-jobs"]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in job_roles) == [("Role", "ml"), ("Role", "research")]
    stores = [d for d in by_kind(namespaced, "Role") if d["metadata"]["name"] == "rel-tenplex-stores"]
    assert [(d["metadata"]["namespace"], _rules(d)) for d in stores] == [
        ("tenplex", {("", "pods", v, ()) for v in ("list", "watch")})]
    sa = one(namespaced, "ServiceAccount")["metadata"]
    for binding in by_kind(namespaced, "RoleBinding") + by_kind(namespaced, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": "tenplex"}]


def test_auth_secret_value_or_existing() -> None:
    docs = render("--set", "auth.token=s3cret")
    secret = one(docs, "Secret", "rel-tenplex-auth")
    assert secret["data"]["token"] == "czNjcmV0"  # base64 of s3cret
    generated = one(render(), "Secret", "rel-tenplex-auth")["data"]["token"]
    assert len(generated) == 64  # 48 random characters, base64
    existing = render("--set", "auth.existingSecret=team-token", "--set", "auth.existingSecretKey=bearer")
    assert [d["metadata"]["name"] for d in by_kind(existing, "Secret")] == ["rel-tenplex-auth-keys"]
    for workload in by_kind(existing, "Deployment") + by_kind(existing, "DaemonSet"):
        env = {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[crd.ENV_TOKEN]["valueFrom"]["secretKeyRef"] == {"name": "team-token", "key": "bearer"}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["--set", "scheduler.replica=2"], "replica"),
        (["--set", "scheduler.replicas=two"], "replicas"),
        (["--set", "store.root=relative/path"], "root"),
        (["--set", "store.transforms.memory=lots"], "memory"),
        (["--set", "store.transforms.maxRunning=0"], "maxRunning"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "metrics.serviceMonitor.interval=often"], "interval"),
        (["--set", "scheduler.replicas=3", "--set", "scheduler.leaderElection.enabled=false"], "leaderElection.enabled is false"),
        (["--set", "scheduler.leaderElection.renewDeadlineSeconds=20"], "renewDeadlineSeconds (20)"),
        (["--set", "scheduler.leaderElection.retryPeriodSeconds=9"], "1.2 x retryPeriodSeconds (9)"),
    ],
)
def test_bad_values_are_rejected_with_the_offending_key(values: list[str], expected: str) -> None:
    result = helm("template", "rel", str(CHART), *values, check=False)
    assert result.returncode != 0, f"helm accepted {values}"
    assert expected in result.stderr, result.stderr


def test_values_schema_is_strict_json_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_elasticjobs_match_the_crd_schema(path: Path) -> None:
    (definition,) = yaml.safe_load_all((CHART / "crds" / "elasticjobs.tenplex.io.yaml").read_text())
    schema = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    job = yaml.safe_load(path.read_text())
    jsonschema.validate(job, schema)  # the schema exactly as installed in the cluster
    assert crd.elasticjob_errors(job) == []  # plus unknown fields and the CEL rules
    spec = crd.parse_spec(job)
    assert spec.gpus % spec.gpus_per_pod == 0
    spec.layout.to_spec()  # a registered provider; the model fits it


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2


def _workload_env(doc: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_job_credentials_key_set_is_generated_mounted_and_verifies(tmp_path: Path) -> None:
    """The key set the scheduler signs job credentials with, and the daemons verify them with: generated once
    (a valid key set for tenplex.core.auth), mounted without subPath (so an edited Secret reaches the processes)."""
    from tenplex.core.auth import Authenticator, Issuer, KeySet

    docs = render()
    secret = one(docs, "Secret", "rel-tenplex-auth-keys")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (tmp_path / "keys.json").write_bytes(base64.b64decode(secret["data"]["keys.json"]))
    keys = KeySet(tmp_path / "keys.json")
    cred = Issuer(keys).worker("job")
    assert Authenticator(None, keys).authenticate(f"Bearer {cred}").job == "job"
    for kind in ("Deployment", "DaemonSet"):
        pod = one(docs, kind)["spec"]["template"]["spec"]
        assert _workload_env(one(docs, kind))["TENPLEX_AUTH_KEYS"]["value"] == "/etc/tenplex/auth-keys/keys.json"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "auth-keys")
        assert mount == {"name": "auth-keys", "mountPath": "/etc/tenplex/auth-keys", "readOnly": True}
        volume = next(v for v in pod["volumes"] if v["name"] == "auth-keys")
        assert volume["secret"]["secretName"] == "rel-tenplex-auth-keys"
    off = render("--set", "auth.jobCredentials.enabled=false")
    assert "rel-tenplex-auth-keys" not in [d["metadata"]["name"] for d in by_kind(off, "Secret")]
    assert "TENPLEX_AUTH_KEYS" not in _workload_env(one(off, "Deployment"))


def test_tls_values_serve_https_probe_https_and_advertise_https() -> None:
    docs = render(*SECURE)
    scheduler, store = one(docs, "Deployment"), one(docs, "DaemonSet")
    for workload in (scheduler, store):
        env = _workload_env(workload)
        assert {k: env[k]["value"] for k in ("TENPLEX_TLS_CERT", "TENPLEX_TLS_KEY", "TENPLEX_TLS_CA")} == {
            "TENPLEX_TLS_CERT": "/etc/tenplex/tls/tls.crt", "TENPLEX_TLS_KEY": "/etc/tenplex/tls/tls.key",
            "TENPLEX_TLS_CA": "/etc/tenplex/tls/ca.crt"}
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
        volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "tenplex-tls"
    env = _workload_env(scheduler)
    assert env["TENPLEX_ADVERTISE_URL"]["value"] == "https://rel-tenplex-scheduler.tenplex.svc:8080"
    assert env["TENPLEX_TLS_SECRET"]["value"] == "tenplex-tls"
    for monitor in by_kind(docs, "ServiceMonitor"):
        endpoint = monitor["spec"]["endpoints"][0]
        assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"]["name"] == "tenplex-tls"
    plain = render()
    assert _workload_env(one(plain, "Deployment"))["TENPLEX_TLS_SECRET"]["value"] == ""
    assert "TENPLEX_TLS_CERT" not in _workload_env(one(plain, "DaemonSet"))
    bad = helm("template", "rel", str(CHART), "--set", "tls.enabled=true", check=False)
    assert bad.returncode != 0 and "tls.secretName is required" in bad.stderr


def test_network_policies_admit_only_the_release_the_job_pods_and_the_listed_namespaces() -> None:
    docs = render(*SECURE)
    release = {"app.kubernetes.io/name": "tenplex", "app.kubernetes.io/instance": "rel"}
    store = one(docs, "NetworkPolicy", "rel-tenplex-store")["spec"]
    assert store["podSelector"]["matchLabels"] == {**release, "tenplex.io/role": "store"}
    assert store["policyTypes"] == ["Ingress"] and len(store["ingress"]) == 1
    rule = store["ingress"][0]
    assert rule["ports"] == [{"port": 7070, "protocol": "TCP"}]
    jobs = {"podSelector": {"matchLabels": {"tenplex.io/role": "worker"}}, "namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "tenplex"]}]}}
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {**release, "tenplex.io/role": "scheduler"}}},
        {"podSelector": {"matchLabels": {**release, "tenplex.io/role": "store"}}},
        jobs,
        {"ipBlock": {"cidr": "10.0.0.0/16"}}, {"ipBlock": {"cidr": "fd00::/64"}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    ]
    sched = one(docs, "NetworkPolicy", "rel-tenplex-scheduler")["spec"]
    assert sched["podSelector"]["matchLabels"] == {**release, "tenplex.io/role": "scheduler"}
    assert sched["ingress"][0]["ports"] == [{"port": 8080, "protocol": "TCP"}]
    assert sched["ingress"][0]["from"] == [
        jobs,
        {"podSelector": {"matchLabels": {**release, "tenplex.io/role": "store"}}},
        {"ipBlock": {"cidr": "10.0.0.0/16"}}, {"ipBlock": {"cidr": "fd00::/64"}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    ]
    # every namespace's job pods when the release watches all; the worker pods carry the label selected on
    every = one(render(), "NetworkPolicy", "rel-tenplex-store")["spec"]["ingress"][0]["from"][2]
    assert every == {"podSelector": {"matchLabels": {"tenplex.io/role": "worker"}}, "namespaceSelector": {}}
    assert crd.job_labels("j")[crd.LABEL_ROLE] == "worker"
    assert by_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []
    assert [d["metadata"]["name"] for d in by_kind(render("--set", "store.enabled=false"), "NetworkPolicy")] == [
        "rel-tenplex-scheduler"]
    bad = helm("template", "rel", str(CHART), "--set", "networkPolicy.nodeCIDRs={nodes}", check=False)
    assert bad.returncode != 0 and "nodeCIDRs" in bad.stderr
