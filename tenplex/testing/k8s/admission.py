"""What the API server checks and fills in before it stores an object.

* **Built-in kinds** are checked against the real OpenAPI schemas of
  Kubernetes 1.33 that ``kubernetes-validate`` ships (its "strict" variant, in
  which every object lists its fields, so unknown fields are found): a value of
  the wrong JSON type is a decode error (400), a missing required field or a
  value outside an enum is 422 Invalid. On top, the semantic rules of the
  API server's validation that an operator can trip over: names, label and
  annotation syntax, container and volume names, environment variable names,
  resource quantities (and that an extended resource such as ``nvidia.com/gpu``
  is an integer whose request equals its limit), ports, ConfigMap and Secret
  keys and their 1 MiB limit, budgets, events, and which fields of a pod spec
  an update may change.
* **Custom resources** are checked against their CRD's structural schema
  (defaults applied first, as the API server does) and their CEL rules, evaluated
  from the CRD's own strings by :mod:`tenplex.k8s.cel`.
* **Unknown fields** are collected, not judged here: the request's
  ``fieldValidation`` decides (Strict: 400; Warn, the default: dropped with a
  warning; Ignore: dropped).
* **Admission**: pod defaults (grace period, restart and DNS policy, the
  not-ready/unreachable tolerations), ServiceAccount admission (the account must
  exist; its token is mounted unless ``automountServiceAccountToken`` is false)
  and PodSecurity admission by the namespace's
  ``pod-security.kubernetes.io/enforce`` label (baseline forbids host
  namespaces, hostPath volumes, host ports, privileged containers and extra
  capabilities; restricted adds non-root, no privilege escalation, dropped
  capabilities and a seccomp profile).
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema

from tenplex.k8s import cel, crd
from tenplex.testing.k8s.objects import ApiError, ResourceType

K8S_VERSION = "1.33.0"
OBJECT_LIMIT = 1 << 20
"""ConfigMaps and Secrets hold at most 1 MiB of data (etcd's request size)."""

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
LABEL_ENFORCE = "pod-security.kubernetes.io/enforce"
_BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                          "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
STANDARD_FINALIZERS = {"kubernetes", "orphan", "foregroundDeletion"}
POD_DEFAULT_TOLERATIONS = (
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
)


@dataclass
class Verdict:
    """The outcome of checking one object: decode errors (400), invalid fields (422), unknown fields."""

    decode: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    unknown: list[tuple[str | int, ...]] = field(default_factory=list)


def path_text(path: Sequence[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# --------------------------------------------------------------------------- schemas


class BuiltinSchemas:
    """The JSON schemas of Kubernetes' own kinds (``kubernetes-validate``'s strict variant), compiled once."""

    def __init__(self, version: str = K8S_VERSION) -> None:
        self.root = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
        self._registry: referencing.Registry | None = None

    def _definitions(self) -> referencing.Registry:
        if self._registry is None:
            import json

            definitions = json.loads((self.root / "_definitions.json").read_text())
            self._registry = referencing.jsonschema.DRAFT202012.create_resource(definitions) @ referencing.Registry()
        return self._registry

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one instance per emulator process, kept for its life
    def validator(self, api_version: str, kind: str) -> jsonschema.Validator | None:
        import json

        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        path = self.root / f"{kind.lower()}-{group_version}.json"
        if not path.is_file():
            return None
        schema = json.loads(path.read_text())
        registry = referencing.jsonschema.DRAFT202012.create_resource(schema) @ self._definitions()
        return jsonschema.Draft202012Validator(schema, registry=registry)

    def check(self, obj: Mapping[str, Any]) -> Verdict:
        verdict = Verdict()
        validator = self.validator(str(obj.get("apiVersion")), str(obj.get("kind")))
        if validator is None:
            return verdict
        for err in validator.iter_errors(obj):
            _classify(err, verdict, f'{obj.get("kind")}')
        return verdict


def _classify(err: jsonschema.ValidationError, verdict: Verdict, kind: str) -> None:
    path = list(err.absolute_path)
    where = path_text(path) or "<root>"
    if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
        declared = set((err.schema.get("properties") or {}) if isinstance(err.schema, Mapping) else ())
        verdict.unknown += [(*path, k) for k in err.instance if k not in declared]
    elif err.validator == "required" and isinstance(err.instance, Mapping):
        for name in err.validator_value:
            if name not in err.instance:
                verdict.invalid.append(f"{path_text([*path, name])}: Required value")
    elif err.validator == "enum":
        allowed = ", ".join(f'"{v}"' for v in err.validator_value if v is not None)
        verdict.invalid.append(f'{where}: Unsupported value: {_json(err.instance)}: supported values: {allowed}')
    elif err.validator in ("type", "oneOf", "anyOf", "format"):
        verdict.decode.append(f"{kind} in version cannot be handled: json: cannot unmarshal {_json_type(err.instance)} "
                              f"into Go struct field {kind}.{where}")
    else:
        verdict.invalid.append(f"{where}: Invalid value: {_json(err.instance)}: {err.message}")


def _json(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Mapping):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return str(value)


def _json_type(value: Any) -> str:
    return {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


# --------------------------------------------------------------------------- custom resources


def custom_defaults(schema: Mapping[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    """The CRD's structural-schema defaults filled in (the API server defaults on every read and write)."""
    return crd.apply_defaults(schema, obj)


def custom_unknown(schema: Mapping[str, Any], obj: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Paths of fields the structural schema does not declare (what the API server prunes)."""
    if isinstance(obj, Mapping):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        if not path:  # the root: apiVersion, kind and metadata are always known
            props = {**(props or {}), "apiVersion": {}, "kind": {}, "metadata": {"x-kubernetes-preserve-unknown-fields": True}}
        for key, value in obj.items():
            if props is not None and key in props:
                yield from custom_unknown(props[key], value, (*path, key))
            elif isinstance(extra, Mapping):
                yield from custom_unknown(extra, value, (*path, key))
            elif not preserve and extra is not True:
                yield (*path, key)
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            yield from custom_unknown(schema["items"], item, (*path, i))


def custom_check(rt: ResourceType, obj: Mapping[str, Any]) -> Verdict:
    """Schema errors (422) and CEL rule failures (422) of a custom resource; its unknown fields."""
    assert rt.schema is not None
    verdict = Verdict(unknown=list(custom_unknown(rt.schema, obj)))
    schema = dict(rt.schema)
    schema["properties"] = {**schema.get("properties", {}), "metadata": {"type": "object"}}
    pruned = prune(obj, verdict.unknown)
    for err in sorted(jsonschema.Draft7Validator(schema).iter_errors(pruned), key=lambda e: list(map(str, e.absolute_path))):
        where = path_text(list(err.absolute_path)) or "<root>"
        if err.validator == "required":
            for name in err.validator_value:
                if isinstance(err.instance, Mapping) and name not in err.instance:
                    verdict.invalid.append(f"{path_text([*err.absolute_path, name])}: Required value")
        elif err.validator == "enum":
            allowed = ", ".join(f'"{v}"' for v in err.validator_value)
            verdict.invalid.append(f"{where}: Unsupported value: {_json(err.instance)}: supported values: {allowed}")
        elif err.validator == "type":
            verdict.invalid.append(f'{where}: Invalid value: "{_json_type(err.instance)}": {where} in body must be of '
                                   f'type {err.validator_value}: {_json(err.instance)}')
        else:
            verdict.invalid.append(f"{where}: Invalid value: {_json(err.instance)}: {where} in body {err.message}")
    if not verdict.invalid:
        verdict.invalid += [str(f) for f in cel.evaluate(rt.schema, pruned)]
    return verdict


def prune(obj: Any, paths: Sequence[tuple[str | int, ...]]) -> Any:
    """A copy of ``obj`` without the fields at ``paths`` (deepest first, so indices stay right)."""
    out = copy.deepcopy(obj)
    for path in sorted(paths, key=len, reverse=True):
        cur = out
        for p in path[:-1]:
            cur = cur[p]
        if isinstance(cur, dict):
            cur.pop(path[-1], None)
    return out


# --------------------------------------------------------------------------- semantics of built-in kinds


def qualified_name_errors(where: str, name: str) -> list[str]:
    prefix, _, local = name.rpartition("/")
    errors = []
    if prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix)):
        errors.append(f'{where}: Invalid value: "{name}": prefix part must be a lowercase RFC 1123 subdomain')
    if not local or len(local) > 63 or not _QUALIFIED.match(local):
        errors.append(f'{where}: Invalid value: "{name}": name part must consist of alphanumeric characters, '
                      "'-', '_' or '.', and must start and end with an alphanumeric character (at most 63)")
    return errors


def metadata_errors(rt: ResourceType, obj: Mapping[str, Any]) -> list[str]:
    meta = obj.get("metadata") or {}
    errors: list[str] = []
    name = str(meta.get("name") or "")
    pattern = DNS_LABEL if rt.plural in ("namespaces", "services") else DNS_SUBDOMAIN
    limit = 63 if pattern is DNS_LABEL else 253
    if name and (len(name) > limit or not pattern.match(name)):
        kind = "RFC 1123 label" if pattern is DNS_LABEL else "RFC 1123 subdomain"
        errors.append(f'metadata.name: Invalid value: "{name}": a lowercase {kind} must consist of lower case '
                      "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character")
    for key, value in (meta.get("labels") or {}).items():
        errors += qualified_name_errors("metadata.labels", key)
        if value and (len(str(value)) > 63 or not _QUALIFIED.match(str(value))):
            errors.append(f'metadata.labels: Invalid value: "{value}": a valid label must be an empty string or '
                          "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                          "alphanumeric character (at most 63)")
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += qualified_name_errors("metadata.annotations", key)
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > 256 * 1024:
        errors.append("metadata.annotations: Too long: must have at most 262144 bytes")
    for i, fin in enumerate(meta.get("finalizers") or []):
        if fin not in STANDARD_FINALIZERS:
            errors += qualified_name_errors(f"metadata.finalizers[{i}]", str(fin))
    refs = meta.get("ownerReferences") or []
    if sum(1 for r in refs if r.get("controller")) > 1:
        errors.append("metadata.ownerReferences: Invalid value: only one reference can have Controller set to true")
    for i, ref in enumerate(refs):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                errors.append(f"metadata.ownerReferences[{i}].{key}: Required value")
    return errors


def quantity_errors(where: str, value: Any) -> list[str]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return []
    if not isinstance(value, str) or not _QUANTITY.match(value):
        return [f"{where}: Invalid value: {_json(value)}: quantities must match the regular expression "
                "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"]
    return []


def _quantity_value(text: Any) -> float:
    text = str(text)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": 1e-9, "u": 1e-6,
                "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _extended(resource: str) -> bool:
    """An extended resource (a device plugin's, e.g. nvidia.com/gpu): integers, never overcommitted."""
    return "/" in resource and not resource.startswith(("kubernetes.io/", "requests."))


def container_errors(where: str, c: Mapping[str, Any], volumes: set[str], host_network: bool) -> list[str]:
    errors: list[str] = []
    name = str(c.get("name") or "")
    if name and (len(name) > 63 or not DNS_LABEL.match(name)):
        errors.append(f'{where}.name: Invalid value: "{name}": a lowercase RFC 1123 label must consist of lower case '
                      "alphanumeric characters or '-', and must start and end with an alphanumeric character")
    if not c.get("image"):
        errors.append(f"{where}.image: Required value")
    for i, env in enumerate(c.get("env") or []):
        env_name = str(env.get("name") or "")
        if not _ENV_NAME.match(env_name):
            errors.append(f'{where}.env[{i}].name: Invalid value: "{env_name}": a valid environment variable name '
                          "must consist of alphabetic characters, digits, '_', '-', or '.', and must not start "
                          "with a digit")
        if env.get("value") and env.get("valueFrom"):
            errors.append(f"{where}.env[{i}].valueFrom: Invalid value: \"\": may not be specified when `value` is "
                          "not empty")
        source = env.get("valueFrom") or {}
        if env.get("valueFrom") is not None and len([k for k in source if source[k] is not None]) != 1:
            errors.append(f"{where}.env[{i}].valueFrom: Invalid value: \"\": must specify one of: `fieldRef`, "
                          "`resourceFieldRef`, `configMapKeyRef` or `secretKeyRef`")
    res = c.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for kind, values in (("requests", requests), ("limits", limits)):
        for resource, value in values.items():
            errors += quantity_errors(f"{where}.resources.{kind}[{resource}]", value)
            if _extended(resource) and not quantity_errors("", value) and _quantity_value(value) % 1:
                errors.append(f"{where}.resources.{kind}[{resource}]: Invalid value: {_json(value)}: must be an integer")
    if not errors:
        for resource, value in requests.items():
            if _extended(resource):
                if resource not in limits:
                    errors.append(f"{where}.resources.limits: Required value: Limit must be set for non "
                                  f"overcommitable resources ({resource})")
                elif _quantity_value(limits[resource]) != _quantity_value(value):
                    errors.append(f"{where}.resources.requests[{resource}]: Invalid value: {_json(value)}: must be "
                                  f"equal to {resource} limit of {limits[resource]}")
            elif resource in limits and _quantity_value(value) > _quantity_value(limits[resource]):
                errors.append(f"{where}.resources.requests[{resource}]: Invalid value: {_json(value)}: must be less "
                              f"than or equal to {resource} limit of {limits[resource]}")
    mounts: set[str] = set()
    for i, m in enumerate(c.get("volumeMounts") or []):
        if m.get("name") not in volumes:
            errors.append(f'{where}.volumeMounts[{i}].name: Not found: "{m.get("name")}"')
        if m.get("mountPath") in mounts:
            errors.append(f'{where}.volumeMounts[{i}].mountPath: Invalid value: "{m.get("mountPath")}": must be unique')
        mounts.add(str(m.get("mountPath")))
    for i, p in enumerate(c.get("ports") or []):
        port, host = p.get("containerPort"), p.get("hostPort")
        if isinstance(port, int) and not 0 < port < 65536:
            errors.append(f"{where}.ports[{i}].containerPort: Invalid value: {port}: must be between 1 and 65535")
        if isinstance(host, int) and not 0 <= host < 65536:
            errors.append(f"{where}.ports[{i}].hostPort: Invalid value: {host}: must be between 1 and 65535")
        if host_network and host not in (None, 0) and host != port:
            errors.append(f"{where}.ports[{i}].hostPort: Invalid value: {host}: must match `containerPort` when "
                          "`hostNetwork` is true")
        if p.get("name") and (len(str(p["name"])) > 15 or not _PORT_NAME.match(str(p["name"]))):
            errors.append(f'{where}.ports[{i}].name: Invalid value: "{p["name"]}": must be no more than 15 '
                          "characters, lower case alphanumeric or '-'")
    return errors


def pod_spec_errors(spec: Mapping[str, Any]) -> list[str]:
    errors: list[str] = []
    volumes: set[str] = set()
    for i, v in enumerate(spec.get("volumes") or []):
        name = str(v.get("name") or "")
        if name in volumes:
            errors.append(f'spec.volumes[{i}].name: Duplicate value: "{name}"')
        elif not DNS_LABEL.match(name) or len(name) > 63:
            errors.append(f'spec.volumes[{i}].name: Invalid value: "{name}": a lowercase RFC 1123 label')
        volumes.add(name)
    names: set[str] = set()
    host_network = bool(spec.get("hostNetwork"))
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(kind) or []):
            if c.get("name") in names:
                errors.append(f'spec.{kind}[{i}].name: Duplicate value: "{c.get("name")}"')
            names.add(str(c.get("name")))
            errors += container_errors(f"spec.{kind}[{i}]", c, volumes, host_network)
    if not spec.get("containers"):
        errors.append("spec.containers: Required value")
    node = spec.get("nodeName")
    if node and not DNS_SUBDOMAIN.match(str(node)):
        errors.append(f'spec.nodeName: Invalid value: "{node}": a lowercase RFC 1123 subdomain')
    for key, allowed in (("restartPolicy", ("Always", "OnFailure", "Never")),
                         ("dnsPolicy", ("ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"))):
        if key in spec and spec[key] not in allowed:
            supported = ", ".join(f'"{a}"' for a in allowed)
            errors.append(f'spec.{key}: Unsupported value: {_json(spec[key])}: supported values: {supported}')
    grace = spec.get("terminationGracePeriodSeconds")
    if isinstance(grace, int) and grace < 0:
        errors.append(f"spec.terminationGracePeriodSeconds: Invalid value: {grace}: must be greater than or equal to 0")
    return errors


_POD_MUTABLE = "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`," \
               "`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds`"


def pod_update_errors(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """A pod's spec is immutable but for images, the deadline and added tolerations (nodeName goes by binding)."""
    a, b = copy.deepcopy(dict(old.get("spec") or {})), copy.deepcopy(dict(new.get("spec") or {}))
    for spec in (a, b):
        for kind in ("containers", "initContainers"):
            for c in spec.get(kind) or []:
                c.pop("image", None)
        spec.pop("activeDeadlineSeconds", None)
        spec.pop("terminationGracePeriodSeconds", None)
    old_tol = a.pop("tolerations", None) or []
    new_tol = b.pop("tolerations", None) or []
    if a != b or any(t not in new_tol for t in old_tol):
        return [f"spec: Forbidden: pod updates may not change fields other than {_POD_MUTABLE}"]
    return []


def data_errors(rt: ResourceType, obj: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """ConfigMap and Secret data: keys, base64 (a decode error, 400) and the 1 MiB limit (422)."""
    decode: list[str] = []
    invalid: list[str] = []
    size = 0
    sections = ("data", "binaryData") if rt.kind == "ConfigMap" else ("data", "stringData")
    for section in sections:
        for key, value in (obj.get(section) or {}).items():
            if not _CONFIG_KEY.match(key) or len(key) > 253:
                invalid.append(f'{section}[{key}]: Invalid value: "{key}": a valid config key must consist of '
                               "alphanumeric characters, '-', '_' or '.'")
            base64_encoded = section == "binaryData" or (rt.kind == "Secret" and section == "data")
            if base64_encoded:
                try:
                    size += len(base64.b64decode(str(value), validate=True))
                except (binascii.Error, ValueError) as exc:
                    decode.append(f"{rt.kind} in version \"v1\" cannot be handled as a {rt.kind}: illegal base64 "
                                  f"data in {section}[{key}]: {exc}")
            else:
                size += len(str(value).encode())
    if rt.kind == "ConfigMap":
        both = set(obj.get("data") or {}) & set(obj.get("binaryData") or {})
        invalid += [f'data[{k}]: Invalid value: "{k}": duplicate of key present in binaryData' for k in sorted(both)]
    if size > OBJECT_LIMIT:
        where = "[]" if rt.kind == "ConfigMap" else "data"
        invalid.append(f"{where}: Too long: must have at most {OBJECT_LIMIT} bytes")
    return decode, invalid


def semantic_errors(rt: ResourceType, obj: Mapping[str, Any], old: Mapping[str, Any] | None,
                    previous: Mapping[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """(decode errors, invalid fields) beyond the schema, for the kinds the scheduler and the tests write; ``old`` is
    the stored object on a spec update, ``previous`` on any update (a terminated pod stays terminated)."""
    decode: list[str] = []
    invalid = metadata_errors(rt, obj)
    if rt.kind == "Pod":
        invalid += pod_spec_errors(obj.get("spec") or {})
        if old is not None:
            invalid += pod_update_errors(old, obj)
        before = ((previous or {}).get("status") or {}).get("phase")
        after = (obj.get("status") or {}).get("phase")
        if before in ("Succeeded", "Failed") and after != before:
            invalid.append(f'status.phase: Forbidden: cannot transition from terminal phase "{before}" to "{after}"')
    elif rt.kind in ("ConfigMap", "Secret"):
        d, i = data_errors(rt, obj)
        decode += d
        invalid += i
    elif rt.kind == "PodDisruptionBudget":
        spec = obj.get("spec") or {}
        if "minAvailable" in spec and "maxUnavailable" in spec:
            invalid.append("spec: Invalid value: minAvailable and maxUnavailable cannot be both set")
    elif rt.kind == "Event":
        involved = (obj.get("involvedObject") or {}).get("namespace")
        ns = (obj.get("metadata") or {}).get("namespace")
        if involved and involved != ns:
            invalid.append(f'involvedObject.namespace: Invalid value: "{involved}": does not match event.namespace')
    elif rt.kind == "Lease":
        duration = (obj.get("spec") or {}).get("leaseDurationSeconds")
        if isinstance(duration, int) and duration <= 0:
            invalid.append(f"spec.leaseDurationSeconds: Invalid value: {duration}: must be greater than 0")
    return decode, invalid


# --------------------------------------------------------------------------- admission


def pod_defaults(pod: dict[str, Any]) -> dict[str, Any]:
    """What the API server's defaulting and the DefaultTolerationSeconds admission plugin add to a new pod."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            image = str(c.get("image") or "")
            tag = image.rsplit("/", 1)[-1].partition(":")[2] if "@" not in image else "digest"
            c.setdefault("imagePullPolicy", "Always" if tag in ("", "latest") else "IfNotPresent")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            for p in c.get("ports") or []:
                p.setdefault("protocol", "TCP")
    tolerations = list(spec.get("tolerations") or [])
    for default in POD_DEFAULT_TOLERATIONS:
        if not any(t.get("key") == default["key"] and t.get("effect") in (None, "", default["effect"])
                   for t in tolerations):
            tolerations.append(dict(default))
    spec["tolerations"] = tolerations
    return pod


def mount_service_account_token(pod: dict[str, Any], account: Mapping[str, Any]) -> None:
    """ServiceAccount admission's token volume, unless the pod or its account opts out."""
    spec = pod["spec"]
    opt = spec.get("automountServiceAccountToken")
    if opt is None:
        opt = account.get("automountServiceAccountToken")
    if opt is False:
        return
    volume = f"kube-api-access-{secrets.token_hex(3)[:5]}"
    spec.setdefault("volumes", []).append({"name": volume, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1",
                                                                      "fieldPath": "metadata.namespace"}}]}}]}})
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            c.setdefault("volumeMounts", []).append({"name": volume, "readOnly": True,
                                                     "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})


def pod_security_violations(level: str, pod: Mapping[str, Any]) -> list[str]:
    """Why ``pod`` breaks the Pod Security Standard ``level`` (baseline or restricted; [] for privileged)."""
    if level not in ("baseline", "restricted"):
        return []
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    out = []
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        out.append(f"host namespaces ({', '.join(hosts)})")
    host_paths = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        out.append(f"hostPath volumes ({', '.join(f'volume {n!r}' for n in host_paths)})")
    ports = [f'container "{c["name"]}" uses hostPort {p["hostPort"]}' for c in containers
             for p in c.get("ports") or [] if p.get("hostPort")]
    if ports:
        out.append(f"hostPort ({'; '.join(ports)})")
    privileged = [c["name"] for c in containers if (c.get("securityContext") or {}).get("privileged")]
    if privileged:
        out.append(f"privileged ({', '.join(privileged)})")
    allowed = _BASELINE_CAPABILITIES if level == "baseline" else {"NET_BIND_SERVICE"}
    added = sorted({cap for c in containers
                    for cap in (((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or [])
                    if cap not in allowed})
    if added:
        out.append(f"unrestricted capabilities ({', '.join(added)})")
    if level == "restricted":
        pod_ctx = spec.get("securityContext") or {}
        for c in containers:
            ctx = c.get("securityContext") or {}
            if ctx.get("allowPrivilegeEscalation") is not False:
                out.append(f'allowPrivilegeEscalation != false (container "{c["name"]}")')
            if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
                out.append(f'unrestricted capabilities (container "{c["name"]}" must drop "ALL")')
            if not (ctx.get("runAsNonRoot") if "runAsNonRoot" in ctx else pod_ctx.get("runAsNonRoot")):
                out.append(f'runAsNonRoot != true (container "{c["name"]}")')
            seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                out.append(f'seccompProfile (container "{c["name"]}" must set type "RuntimeDefault" or "Localhost")')
        bad = [v["name"] for v in spec.get("volumes") or [] if not set(v) - {"name"} <= _RESTRICTED_VOLUMES]
        if bad:
            out.append(f"restricted volume types ({', '.join(bad)})")
    return out


def raise_decode(rt: ResourceType, errors: list[str]) -> None:
    if errors:
        raise ApiError(400, "BadRequest", "; ".join(errors))
