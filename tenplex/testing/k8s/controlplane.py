"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler v1.37.2, built from the Go module proxy by ``make k8s-testbed`` into ``.tools/k8s``.

Why real: every Kubernetes claim Tenplex makes (the chart installs, its RBAC suffices, ``kubectl scale``
resizes a job, owned objects are collected, the CRD's schema and CEL rules refuse bad specs, watches survive
an API server restart) is only worth what the server it was checked against is worth.

What runs, as a production cluster runs it (kubeadm's choices where there is one):

* etcd on a loopback port, its data in the cluster's directory (``--unsafe-no-fsync``: a test cluster's
  durability is not the point, and fsyncs dominate etcd's latency on a shared VM).
* kube-apiserver with real TLS (a CA made here with ``cryptography``; the serving certificate names 127.0.0.1
  and ``kubernetes.default.svc``), x509 client certificates and a static token file for test identities,
  service-account tokens signed with a key made here (TokenRequest issues them), ``--authorization-mode=Node,RBAC``,
  the default admission plugins plus NodeRestriction, and an audit log (level Metadata) from which
  :meth:`ControlPlane.accesses` reads who asked for what and whether the authorizer allowed it.
* kube-controller-manager with the default controllers (garbage collector, namespace, service accounts and
  their tokens, node lifecycle, DaemonSet, Deployment, ReplicaSet, ...), each with its own service-account
  credentials.
* kube-scheduler binding pods that name no node.

What does not run: a real kubelet, a container runtime, kube-proxy, a CNI plugin, cloud controllers. The
test kubelets (:mod:`tenplex.testing.k8s.kubelet`) play the node side: they register Nodes, renew their
Leases, run bound pods as local processes and honour graceful deletion.

Identities: :class:`User` is a user name and groups. The admin is ``system:masters``; a node is
``system:node:NAME`` in ``system:nodes`` (the Node authorizer and NodeRestriction apply to it); any other user
gets a client certificate signed by the cluster's CA on demand; a service account gets a real bound token
from the TokenRequest API.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tenplex.sockets import free_port

LOG = logging.getLogger(__name__)

VERSION = "v1.37.2"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
ADMIN_TOKEN_USER = "tenplex-admin"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "None", "users": ["system:apiserver", "system:kube-scheduler",
                                                      "system:kube-controller-manager"]},
                          {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
                          {"level": "Metadata"}]}
"""Every request but the control plane's own, at level Metadata (who, what, the authorizer's decision)."""


@dataclass(frozen=True)
class User:
    """An identity the API server authenticates (by a client certificate or a service-account token)."""

    name: str
    groups: tuple[str, ...] = ()

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        return cls(f"system:serviceaccount:{namespace}:{name}",
                   ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))

    @classmethod
    def node(cls, node: str) -> User:
        return cls(f"system:node:{node}", ("system:nodes", "system:authenticated"))

    @property
    def service_account_ref(self) -> tuple[str, str] | None:
        """(namespace, name) of a service account's user, else None."""
        parts = self.name.split(":")
        if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
            return parts[2], parts[3]
        return None


ADMIN = User("kubernetes-admin", ("system:masters",))


@dataclass(frozen=True)
class Access:
    """One request as the audit log records it: who, the RBAC attributes, and whether it was allowed."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    allowed: bool
    code: int
    while_starting: bool = False
    """Received while a restarted API server was not ready yet (its authorizer may deny anything then)."""

    def __str__(self) -> str:
        what = self.resource + (f"/{self.subresource}" if self.subresource else "")
        if self.group:
            what = f"{what}.{self.group}"
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {what}{f' {self.name}' if self.name else ''}{where} -> {self.code}"


class ControlPlaneMissing(RuntimeError):
    """The binaries are not built (and could not be: no Go), so the cluster cannot start."""


def binaries_dir(repo: Path) -> Path:
    return repo / ".tools" / "k8s"


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


# --------------------------------------------------------------------------- certificates


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class _Pki:
    """The cluster's CA and what it signs (EC P-256: fast to make)."""

    def __init__(self, root: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ec, self._oid, self._ser = x509, hashes, ec, NameOID, serialization
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tenplex-test-ca")])
        self.ca_cert = self._sign(name, self.ca_key.public_key(), ca=True, issuer=name)
        self.ca_file = self._write("ca.crt", self.ca_cert.public_bytes(serialization.Encoding.PEM))
        self._issued: dict[User, tuple[Path, Path]] = {}

    def _write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def _sign(self, subject: Any, public_key: Any, *, ca: bool = False, issuer: Any = None,
              sans: list[Any] | None = None, server: bool = False) -> Any:
        x509, ext = self._x509, self._x509.oid.ExtendedKeyUsageOID
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer if issuer is not None else self.ca_cert.subject)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
                critical=True)
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage(
                [ext.SERVER_AUTH] if server else [ext.CLIENT_AUTH]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.ca_key, self._hashes.SHA256())

    def serving(self, host: str) -> tuple[Path, Path]:
        x509 = self._x509
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        sans: list[Any] = [x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")]
        sans += [x509.DNSName(n) for n in ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                           "kubernetes.default.svc.cluster.local")]
        cert = self._sign(x509.Name([x509.NameAttribute(self._oid.COMMON_NAME, "kube-apiserver")]),
                          key.public_key(), sans=sans, server=True)
        return (self._write("apiserver.crt", cert.public_bytes(self._ser.Encoding.PEM)),
                self._write("apiserver.key", _pem_key(key)))

    def client(self, user: User) -> tuple[Path, Path]:
        """A client certificate and key for ``user`` (CN = name, O = groups), made once."""
        if user not in self._issued:
            x509 = self._x509
            key = self._ec.generate_private_key(self._ec.SECP256R1())
            attrs = [x509.NameAttribute(self._oid.COMMON_NAME, user.name)]
            attrs += [x509.NameAttribute(self._oid.ORGANIZATION_NAME, g) for g in user.groups
                      if g != "system:authenticated"]
            cert = self._sign(x509.Name(attrs), key.public_key())
            stem = f"client-{len(self._issued)}"
            self._issued[user] = (self._write(f"{stem}.crt", cert.public_bytes(self._ser.Encoding.PEM)),
                                  self._write(f"{stem}.key", _pem_key(key)))
        return self._issued[user]

    def service_account_keys(self) -> tuple[Path, Path]:
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        public = key.public_key().public_bytes(self._ser.Encoding.PEM, self._ser.PublicFormat.SubjectPublicKeyInfo)
        return self._write("sa.key", _pem_key(key)), self._write("sa.pub", public)


# --------------------------------------------------------------------------- processes


@dataclass
class _Process:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it)
        try:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        finally:
            log.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait(timeout=timeout)
        self.process = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class _Gate:
    """A TCP forwarder in front of kube-apiserver, as a cluster's load balancer with a health check: it lets
    connections through only while the server behind it is ready. A kube-apiserver that is starting serves
    requests before its authorizer's caches have synced, and denies then what RBAC would allow; clients of a
    real cluster do not see that window (the load balancer waits for ``/readyz``), nor do the tests'."""

    def __init__(self, host: str, port: int, backend: tuple[str, int]) -> None:
        self.backend = backend
        self.open = threading.Event()
        self._listener = socket.create_server((host, port))
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"apiserver-gate-{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                conn.close()  # not ready: as a load balancer with no healthy backend
                continue
            try:
                upstream = socket.create_connection(self.backend, timeout=5)
                upstream.settimeout(None)
            except OSError:
                conn.close()
                continue
            with self._lock:  # under the lock drop() takes: a connection is either ended by it or not let through
                if not self.open.is_set():
                    for sock in (conn, upstream):
                        sock.close()
                    continue
                self._conns.update((conn, upstream))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                with self._lock:
                    self._conns.discard(sock)

    def drop(self) -> None:
        """Stop letting connections through and end those open (the server behind is going)."""
        with self._lock:
            self.open.clear()
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.drop()
        self._listener.close()


@dataclass
class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler under ``root`` (see the module docstring).

    ``controllers``: the controller-manager's ``--controllers`` (its defaults: ``*``);
    ``node_monitor_grace_period``: how long a node's kubelet may stay silent before the node lifecycle
    controller marks it Unknown (and taints it).
    """

    root: Path
    bin_dir: Path
    host: str = "127.0.0.1"
    controllers: str = "*"
    node_monitor_grace_period: str = "40s"
    crds: tuple[Mapping[str, Any], ...] = ()
    """CustomResourceDefinitions created before the controllers start (so that the garbage collector knows
    their kinds from its first sync instead of its periodic rediscovery, every 30 s)."""
    _procs: dict[str, _Process] = field(default_factory=dict)
    _sa_tokens: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneMissing(f"{', '.join(missing)} missing from {self.bin_dir} (make k8s-testbed builds them)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.pki = _Pki(self.root / "pki")
        self.serving = self.pki.serving(self.host)
        self.sa_key, self.sa_pub = self.pki.service_account_keys()
        self.admin_token = os.urandom(16).hex()
        tokens = self.root / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n')
        tokens.chmod(0o600)
        self._tokens_file = tokens
        self._audit_policy = self.root / "audit-policy.yaml"
        self._audit_policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        self.audit_log = self.root / "audit.log"
        self._audit_offset = 0
        self._accesses: list[Access] = []
        self._open_watches: dict[str, str] = {}
        self._starting: list[tuple[datetime.datetime, datetime.datetime]] = []
        self.etcd_port = free_port(self.host, 2)
        taken = frozenset({self.etcd_port, self.etcd_port + 1})
        self.port = free_port(self.host, avoid=taken)
        """The API's address for every client: the gate in front of kube-apiserver's own port."""
        self._apiserver_port = free_port(self.host, avoid=taken | {self.port})
        self._gate: _Gate | None = None

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://{self.host}:{self.etcd_port}"

    def _kubeconfig_file(self, name: str, user: User) -> Path:
        path = self.root / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(self.kubeconfig(user)))
        path.chmod(0o600)
        return path

    def start(self, timeout: float = 120.0) -> ControlPlane:
        began = time.monotonic()
        try:
            self._start_etcd()
            self._start_apiserver(timeout)
            for manifest in self.crds:
                self._post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", manifest)
            self._start_controller_manager()
            self._start_scheduler()
            self._wait(lambda: self._service_account_exists("default", "default"),
                       "the controller-manager's default ServiceAccount", timeout)
        except BaseException:
            self.stop()
            raise
        LOG.info("test cluster %s up in %.1fs (logs in %s)", self.url, time.monotonic() - began, self.root)
        return self

    def stop(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self._procs.get(name)
            if proc is not None:
                proc.stop()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> _Process:
        proc = _Process(name, argv, self.root / f"{name}.log")
        self._procs[name] = proc
        proc.start()
        return proc

    def _wait(self, predicate: Any, what: str, timeout: float, proc: _Process | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
            if time.monotonic() > deadline:
                tail = f":\n{proc.tail()}" if proc is not None else ""
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
            time.sleep(0.1)

    def _start_etcd(self) -> None:
        peer = f"http://{self.host}:{self.etcd_port + 1}"
        proc = self._spawn("etcd", [
            str(self.bin_dir / "etcd"), "--name", "test", "--data-dir", str(self.root / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}",
            "--unsafe-no-fsync", "--log-level", "warn"])
        self._wait(lambda: self._http_ok(f"{self.etcd_url}/health"), "etcd", 30, proc)

    def _start_apiserver(self, timeout: float = 120.0) -> None:
        cert, key = self.serving
        proc = self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}", f"--advertise-address={self.host}", f"--secure-port={self._apiserver_port}",
            f"--tls-cert-file={cert}", f"--tls-private-key-file={key}", f"--client-ca-file={self.pki.ca_file}",
            f"--token-auth-file={self._tokens_file}",
            f"--service-account-key-file={self.sa_pub}", f"--service-account-signing-key-file={self.sa_key}",
            f"--service-account-issuer={SA_ISSUER}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
            "--endpoint-reconciler-type=none",
            f"--audit-policy-file={self._audit_policy}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
            "--profiling=false", "--v=1"])
        self._wait(self._ready, "kube-apiserver /readyz", timeout, proc)
        self._wait(self._authorizer_synced, "kube-apiserver's authorizer", timeout, proc)
        if self._gate is None:
            self._gate = _Gate(self.host, self.port, (self.host, self._apiserver_port))
        self._gate.open.set()

    def _start_controller_manager(self) -> None:
        kubeconfig = self._kubeconfig_file("controller-manager", User("system:kube-controller-manager"))
        self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.sa_key}", f"--root-ca-file={self.pki.ca_file}",
            f"--controllers={self.controllers}", f"--node-monitor-grace-period={self.node_monitor_grace_period}",
            "--bind-address=127.0.0.1", "--secure-port=0", "--v=1"])

    def _start_scheduler(self) -> None:
        kubeconfig = self._kubeconfig_file("scheduler", User("system:kube-scheduler"))
        self._spawn("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"), f"--kubeconfig={kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", "--secure-port=0", "--v=1"])

    def restart_apiserver(self, *, compact: bool = False, timeout: float = 120.0) -> None:
        """Stop kube-apiserver (every watch ends, connections are refused), optionally compact etcd's history
        (a client resuming from a resourceVersion seen so far is then answered 410 Gone), start it again."""
        with self.apiserver_down(compact=compact, timeout=timeout):
            pass

    @contextlib.contextmanager
    def apiserver_down(self, *, compact: bool = False, timeout: float = 120.0) -> Iterator[None]:
        """kube-apiserver is down inside the block, then back on the same address with every object kept."""
        if self._gate is not None:
            self._gate.drop()
        self._procs["kube-apiserver"].stop()
        self.accesses()
        self._open_watches.clear()  # every watch ended with the server
        down = datetime.datetime.now(datetime.UTC)
        try:
            if compact:
                self.compact_etcd()
            yield
        finally:
            self._start_apiserver(timeout)
            self._starting.append((down, datetime.datetime.now(datetime.UTC)))

    def _authorizer_synced(self) -> bool:
        """Whether RBAC answers as it should: the controller-manager's identity may list nodes (it is not audited)."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        cert, key = self.pki.client(User("system:kube-controller-manager"))
        ctx.load_cert_chain(str(cert), str(key))
        return self._http_ok(f"{self._direct_url}/api/v1/nodes?limit=1", ctx)

    def restart_scheduler(self) -> None:
        self._procs["kube-scheduler"].stop()
        self._start_scheduler()

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (through etcd's gRPC gateway); returns it."""
        revision = int(self._etcd_post("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        self._etcd_post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    def _etcd_post(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    # -- health --------------------------------------------------------------------------

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        cert, key = self.pki.client(ADMIN)
        ctx.load_cert_chain(str(cert), str(key))
        return ctx

    @staticmethod
    def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    @property
    def _direct_url(self) -> str:
        return f"https://{self.host}:{self._apiserver_port}"

    def _ready(self) -> bool:
        return self._http_ok(f"{self._direct_url}/readyz", self._ssl_context())

    def get_json(self, path: str) -> Any:
        """GET ``path`` as the admin (e.g. ``/metrics`` is text: use :meth:`get_text`)."""
        return json.loads(self.get_text(path))

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10, context=self._ssl_context()) as response:
            return str(response.read().decode())

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10, context=self._ssl_context()) as response:
            return json.loads(response.read())

    def _service_account_exists(self, namespace: str, name: str) -> bool:
        try:
            self.get_json(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
            return True
        except OSError:
            return False

    def open_watches(self, user: str | None = None) -> int:
        """Watches open now (of ``user``), as the audit log tells: the control plane's own are not counted."""
        self.accesses()
        return sum(1 for u in self._open_watches.values() if user is None or u == user)

    # -- identities and clients ---------------------------------------------------------------

    def token(self, user: User) -> str | None:
        """A bearer token for a service account's user (TokenRequest, one hour), None for other users."""
        ref = user.service_account_ref
        if ref is None:
            return None
        if ref not in self._sa_tokens:
            namespace, name = ref
            body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                    "spec": {"expirationSeconds": 3600}}
            request = urllib.request.Request(
                f"{self.url}/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10, context=self._ssl_context()) as response:
                self._sa_tokens[ref] = json.loads(response.read())["status"]["token"]
        return self._sa_tokens[ref]

    def forget_tokens(self) -> None:
        """Drop the cached service-account tokens (their accounts were deleted: the tokens are void)."""
        self._sa_tokens.clear()

    def client_configuration(self, user: User | None = None) -> Any:
        """A ``kubernetes.client.Configuration`` for ``user`` (the admin by default), verifying the server."""
        from kubernetes import client

        user = user or ADMIN
        cfg = client.Configuration(host=self.url)
        cfg.ssl_ca_cert = str(self.pki.ca_file)
        token = self.token(user)
        if token is not None:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        else:
            cert, key = self.pki.client(user)
            cfg.cert_file, cfg.key_file = str(cert), str(key)
        return cfg

    def api_client(self, user: User | None = None) -> Any:
        from kubernetes import client

        return client.ApiClient(self.client_configuration(user))

    def kubeconfig(self, user: User | None = None, namespace: str = "default") -> dict[str, Any]:
        """A kubeconfig (as data) for kubectl and helm."""
        user = user or ADMIN
        token = self.token(user)
        if token is not None:
            creds: dict[str, Any] = {"token": token}
        else:
            cert, key = self.pki.client(user)
            creds = {"client-certificate": str(cert), "client-key": str(key)}
        return {"apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                          "certificate-authority": str(self.pki.ca_file)}}],
                "users": [{"name": "test", "user": creds}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                          "namespace": namespace}}]}

    # -- the audit log ----------------------------------------------------------------------

    def accesses(self, user: str | None = None) -> list[Access]:
        """Every request (of ``user``) the audit log holds so far, with the authorizer's decision."""
        if self.audit_log.exists():
            with open(self.audit_log, "rb") as f:
                f.seek(self._audit_offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._audit_offset += end
            for line in data[:end].splitlines():
                event = json.loads(line)
                stage, verb, audit_id = event.get("stage"), event.get("verb", ""), event.get("auditID", "")
                if verb == "watch":  # recorded when it starts (its ResponseComplete comes when it ends)
                    if stage == "ResponseStarted":
                        self._open_watches[audit_id] = (event.get("user") or {}).get("username", "")
                    elif stage == "ResponseComplete" and audit_id in self._open_watches:
                        del self._open_watches[audit_id]
                        continue
                if stage not in ("ResponseStarted", "ResponseComplete", "Panic"):
                    continue
                ref = event.get("objectRef") or {}
                decision = (event.get("annotations") or {}).get("authorization.k8s.io/decision")
                code = int((event.get("responseStatus") or {}).get("code") or 0)
                self._accesses.append(Access(
                    (event.get("user") or {}).get("username", ""), event.get("verb", ""), ref.get("apiGroup", ""),
                    ref.get("resource", ""), ref.get("subresource", ""), ref.get("namespace", ""),
                    ref.get("name", ""), decision != "forbid", code,
                    self._while_starting(event.get("requestReceivedTimestamp"))))
        return [a for a in self._accesses if user is None or a.user == user]

    def _while_starting(self, timestamp: str | None) -> bool:
        if not timestamp or not self._starting:
            return False
        when = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        return any(start <= when <= end for start, end in self._starting)

    def clear_accesses(self) -> None:
        self.accesses()
        self._accesses.clear()

    def logs(self) -> dict[str, str]:
        return {name: proc.tail() for name, proc in self._procs.items()}


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
