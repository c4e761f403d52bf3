"""A CRD's CEL validation rules evaluated from the CRD's own strings: the tests' oracle for the models' twins.

The ElasticJob CRD carries its cross-field rules as ``x-kubernetes-validations``
(CEL), which kube-apiserver enforces on every write; the spec models apply the
same rules in Python (:class:`tenplex.scheduler.jobspec.Rule`) for offline
validation. This module evaluates the CRD's strings with ``cel-python`` so that
a test can check, over many generated specs, that the two agree (the real API
server checks the listed cases).

Values are given to CEL typed by the schema, as the API server does: an
``integer`` is a CEL ``int``, a ``number`` a ``double`` even when written as
``1`` (so ``self.fraction > 0.0`` compares like with like), objects are maps
with string keys, arrays lists. A rule runs at its schema node once per value
there: once for a property, once per item for a rule on an array's items.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes

_ENV = celpy.Environment()


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``x-kubernetes-validations`` entry at its place in the schema."""

    location: str
    """Where it runs, ``spec.policy.table[]`` style (``[]`` an array's items, ``{}`` a map's values)."""
    rule: str
    message: str


def rules(schema: Mapping[str, Any]) -> list[Rule]:
    """Every rule of a structural schema, outermost first."""
    return list(_walk_rules(schema, ""))


def _walk_rules(schema: Mapping[str, Any], location: str) -> Iterator[Rule]:
    for entry in schema.get("x-kubernetes-validations") or ():
        yield Rule(location or "<root>", entry["rule"], entry.get("message", ""))
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk_rules(sub, f"{location}.{name}" if location else name)
    if isinstance(schema.get("items"), Mapping):
        yield from _walk_rules(schema["items"], f"{location}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from _walk_rules(schema["additionalProperties"], f"{location}{{}}")


# --------------------------------------------------------------------------- evaluation


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression))


def to_cel(value: Any, schema: Mapping[str, Any] | None) -> Any:
    """A JSON value as a CEL value typed by its schema (see the module docstring)."""
    if value is None:
        return None
    schema = schema or {}
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), Mapping) else None
        return celtypes.ListType([to_cel(v, items) for v in value])
    if isinstance(value, Mapping):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), Mapping) else None
        return celtypes.MapType({celtypes.StringType(k): to_cel(v, props.get(k, extra)) for k, v in value.items()})
    raise TypeError(f"not a JSON value: {value!r}")


@dataclass(frozen=True, slots=True)
class Failure:
    """A rule that a value breaks (or that could not be evaluated on it)."""

    path: str
    """The field path of the value, ``spec.policy.table[0]`` style."""
    rule: str
    message: str
    value: Any
    error: str | None = None
    """Why the rule could not be evaluated (then it counts as broken, as on the API server)."""

    def __str__(self) -> str:
        """As the API server words it: ``<path>: Invalid value: "object": <message>``."""
        kind = '"object"' if isinstance(self.value, Mapping) else '"array"' if isinstance(self.value, list) \
            else repr(self.value)
        if self.error is not None:
            return f"{self.path or '<root>'}: Invalid value: {kind}: rule {self.rule!r} could not be evaluated: {self.error}"
        return f"{self.path or '<root>'}: Invalid value: {kind}: {self.message}"


def evaluate(schema: Mapping[str, Any], value: Any, path: str = "", old: Any = None) -> list[Failure]:
    """Every rule of ``schema`` that ``value`` breaks ([] when none), outermost first. Transition rules (those
    that read ``oldSelf``) run, as on the API server, only on an update (``old``: the value before) and only
    where the old value has the node too (an object's property; not an array's items)."""
    failures: list[Failure] = []
    _check(schema, value, path, failures, old)
    return failures


def _check(schema: Mapping[str, Any], value: Any, path: str, failures: list[Failure], old: Any = None) -> None:
    if value is None:
        return
    for entry in schema.get("x-kubernetes-validations") or ():
        rule, message = entry["rule"], entry.get("message") or f"failed rule: {entry['rule']}"
        bound = {"self": to_cel(value, schema)}
        if "oldSelf" in rule:
            if old is None:
                continue
            bound["oldSelf"] = to_cel(old, schema)
        try:
            result = _program(rule).evaluate(bound)
        except celpy.CELEvalError as exc:
            failures.append(Failure(path, rule, message, value, str(exc.args[0] if exc.args else exc)))
            continue
        if not bool(result):
            failures.append(Failure(path, rule, message, value))
    if isinstance(value, Mapping):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), Mapping) else None
        for key, sub in value.items():
            child = props.get(key, extra)
            if child is not None:
                _check(child, sub, f"{path}.{key}" if path else key, failures,
                       old.get(key) if isinstance(old, Mapping) else None)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{i}]", failures)


__all__ = ["Failure", "Rule", "rules", "evaluate", "to_cel"]
