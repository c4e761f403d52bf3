"""Least privilege, checked: what a user did (the API server's audit log) against what a set of RBAC objects
(e.g. the chart's ``helm template`` output) grants it.

The real RBAC authorizer already refuses what the rules do not allow (the tests see 403s in the audit log);
:func:`audit` adds the other half: every granted verb is one the user needed. An atom (one group, resource,
verb, name list and scope of one rule) is used when some access is allowed by it; a rule listing several
resources or verbs is judged atom by atom, so a verb nobody calls shows up as unused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tenplex.testing.k8s.controlplane import Access, User


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
