"""Who calls the emulated API server, what they call, and whether RBAC lets them.

Every request carries a bearer token; the emulator maps it to a user (and
groups), as the API server's token authenticator does. Each request is
recorded as an :class:`Access` (verb, API group, resource, subresource,
namespace, name), the attributes the RBAC authorizer decides on. Users in
``system:masters`` (the tests' own admin client, kubectl with the emulator's
kubeconfig) may do anything, and so may kubelets (``system:nodes``: the node
authorizer is not emulated); any other user is authorized against the
Role/ClusterRole objects and their bindings stored in the emulator, as the RBAC
authorizer does, so a scheduler given the chart's rendered RBAC runs with
exactly the permissions it would have on a cluster. A refused request is a
403 Forbidden, recorded as refused.

:func:`audit` compares what a user did with what a set of RBAC objects (e.g.
the chart's ``helm template`` output) grants it: the accesses no rule allows
(missing: the call would fail on a cluster) and the grants no access used
(more than least privilege).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SUPERUSERS = "system:masters"
ADMIN = "kubernetes-admin"


@dataclass(frozen=True, slots=True)
class User:
    name: str
    groups: tuple[str, ...] = ("system:authenticated",)

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        return cls(f"system:serviceaccount:{namespace}:{name}",
                   ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))

    @classmethod
    def node(cls, node: str) -> User:
        return cls(f"system:node:{node}", ("system:nodes", "system:authenticated"))

    @property
    def superuser(self) -> bool:
        return SUPERUSERS in self.groups


ADMIN_USER = User(ADMIN, (SUPERUSERS, "system:authenticated"))


@dataclass(frozen=True, slots=True)
class Access:
    """One request's authorization attributes (``namespace`` is "" for cluster-scoped and all-namespaces calls)."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    allowed: bool = True

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """(verb, group, resource, subresource, namespace): what a least-privilege comparison looks at."""
        return (self.verb, self.group, self.resource, self.subresource, self.namespace)

    def __str__(self) -> str:
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = f" in {self.namespace}" if self.namespace else " (cluster-wide)"
        named = f" {self.name}" if self.name else ""
        return f"{self.verb} {self.group or 'core'}/{res}{named}{where}"


def _subject_matches(subject: Mapping[str, Any], binding_ns: str | None, user: User) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns or ""
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    if kind == "User":
        return user.name == subject.get("name")
    if kind == "Group":
        return subject.get("name") in user.groups
    return False


def rule_allows(rule: Mapping[str, Any], access: Access) -> bool:
    """Whether one PolicyRule covers the access (apiGroups, resources with subresources, verbs, resourceNames)."""
    groups = rule.get("apiGroups") or []
    if "*" not in groups and access.group not in groups:
        return False
    wanted = f"{access.resource}/{access.subresource}" if access.subresource else access.resource
    resources = rule.get("resources") or []
    if not any(r in ("*", wanted) or (access.subresource and r == f"*/{access.subresource}")
               or (not access.subresource and r == access.resource) for r in resources):
        return False
    verbs = rule.get("verbs") or []
    if "*" not in verbs and access.verb not in verbs:
        return False
    names = rule.get("resourceNames") or []
    return not names or access.name in names


@dataclass(frozen=True, slots=True)
class Grant:
    """One (binding, rule) pair as it applies to a user: in ``namespace`` or cluster-wide (None)."""

    namespace: str | None
    source: str
    """Role or ClusterRole name and its binding, for messages."""
    rule: Mapping[str, Any]

    def allows(self, access: Access) -> bool:
        if self.namespace is not None and access.namespace != self.namespace:
            return False
        return rule_allows(self.rule, access)

    def atoms(self) -> list[tuple[str | None, str, str, str, tuple[str, ...]]]:
        """The grant spelled out: (namespace, group, resource, verb, resourceNames) each."""
        names = tuple(self.rule.get("resourceNames") or ())
        return [(self.namespace, g, r, v, names) for g in self.rule.get("apiGroups") or []
                for r in self.rule.get("resources") or [] for v in self.rule.get("verbs") or []]


def grants(objects: Iterable[Mapping[str, Any]], user: User) -> list[Grant]:
    """Every rule the RBAC ``objects`` (Roles, ClusterRoles and their bindings) give ``user``, with its scope."""
    objects = list(objects)
    roles = {(o["kind"], (o.get("metadata") or {}).get("namespace"), o["metadata"]["name"]): o for o in objects
             if o.get("kind") in ("Role", "ClusterRole")}
    out: list[Grant] = []
    for binding in objects:
        kind = binding.get("kind")
        if kind not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ns = (binding.get("metadata") or {}).get("namespace") if kind == "RoleBinding" else None
        if not any(_subject_matches(s, ns, user) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        role = roles.get((ref.get("kind"), ns if ref.get("kind") == "Role" else None, ref.get("name")))
        if role is None:
            continue
        source = f"{ref.get('kind')} {ref.get('name')} via {kind} {binding['metadata']['name']}" + (f" in {ns}" if ns else "")
        out += [Grant(ns, source, rule) for rule in role.get("rules") or []]
    return out


def authorize(objects: Iterable[Mapping[str, Any]], user: User, access: Access) -> bool:
    """RBAC's decision; kubelets (``system:nodes``) are let through, as the node authorizer would for their own
    node's pods (which one that is, is not checked)."""
    if user.superuser or "system:nodes" in user.groups:
        return True
    return any(g.allows(access) for g in grants(objects, user))


@dataclass(frozen=True)
class Audit:
    missing: tuple[Access, ...]
    """Accesses no grant allows: they would be refused on a cluster."""
    unused: tuple[tuple[str, tuple[str | None, str, str, str, tuple[str, ...]]], ...]
    """(source, atom) granted but never needed by any access: more than least privilege."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unused

    def report(self) -> str:
        lines = [f"missing: {a}" for a in self.missing]
        lines += [f"unused: {src}: {v} {g or 'core'}/{r}" + (f" names {list(n)}" if n else "")
                  + (f" in {ns}" if ns else " (cluster-wide)") for src, (ns, g, r, v, n) in self.unused]
        return "\n".join(lines)


def audit(objects: Iterable[Mapping[str, Any]], user: User, accesses: Sequence[Access]) -> Audit:
    """Compare what ``user`` did with what ``objects`` grant it (see the module docstring).

    An atom (one group, resource, verb, name list and scope of one rule) is
    used when some access is allowed by it; a rule listing several resources or
    verbs is judged atom by atom, so a verb nobody calls shows up as unused.
    """
    given = grants(objects, user)
    own = [a for a in accesses if a.user == user.name]
    missing = tuple(sorted({a for a in own if not any(g.allows(a) for g in given)}, key=str))
    unused = []
    for g in given:
        for atom in g.atoms():
            ns, group, resource, verb, names = atom
            single = Grant(ns, g.source, {"apiGroups": [group], "resources": [resource], "verbs": [verb],
                                          **({"resourceNames": list(names)} if names else {})})
            if not any(single.allows(a) for a in own):
                unused.append((g.source, atom))
    return Audit(missing, tuple(unused))
