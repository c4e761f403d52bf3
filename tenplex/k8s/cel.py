"""A CRD's CEL validation rules, evaluated from the CRD's own strings, and their cost against the API server's limits.

The ElasticJob CRD carries its cross-field rules as ``x-kubernetes-validations``
(CEL). Kubernetes evaluates them on every create, update and patch; this module
evaluates the very same strings with ``cel-python`` (no hand-written twin that
could drift), so that ``tenplex k8s validate``, the scheduler and the test API
server refuse exactly what a cluster refuses, with the rule's message.

Values are given to CEL typed by the schema, as the API server does: an
``integer`` is a CEL ``int``, a ``number`` a ``double`` even when written as
``1`` (so ``self.fraction > 0.0`` compares like with like), objects are maps
with string keys, arrays lists. A rule runs at its schema node once per value
there: once for a property, once per item for a rule on an array's items.

**Cost.** The API server refuses a CRD whose rules may cost too much:
each rule's estimated cost, times the largest number of values it can be
evaluated on (the product of ``maxItems``/``maxProperties`` above it, or,
below a list or map without one, as many of the smallest value as fit in a
3 MiB request), must stay under 10,000,000 (``StaticEstimatedCostLimit``), and
the sum over the CRD under 100,000,000 (``StaticEstimatedCRDCostLimit``).
:func:`estimate` follows cel-go's estimator (``checker/cost.go``: 1 per
identifier, field selection, presence test, operator and function call; 0 per
literal; ``&&``/``||`` cost both sides, ``?:`` the condition and the dearer
branch) and the API server's cardinality rule
(``apiextensions/validation/cel_validation.go``, ``maxCardinality``); it refuses
comprehension macros (``all``, ``exists``, ``map``, ``filter``), whose cost
depends on list sizes, rather than underestimate them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes
from lark import Token, Tree

MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
"""The largest request the API server takes (``celconfig.MaxRequestSizeBytes``): what bounds unbounded lists."""
PER_EXPRESSION_COST_LIMIT = 10_000_000
"""``StaticEstimatedCostLimit``: one rule's estimated cost times its cardinality."""
CRD_COST_LIMIT = 100_000_000
"""``StaticEstimatedCRDCostLimit``: the sum over every rule of the CRD."""
PER_CALL_COST_LIMIT = 1_000_000
"""``celconfig.PerCallLimit``: one evaluation of one rule."""

_MACROS = ("all", "exists", "exists_one", "map", "filter")
_ENV = celpy.Environment()


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``x-kubernetes-validations`` entry at its place in the schema."""

    location: str
    """Where it runs, ``spec.policy.table[]`` style (``[]`` an array's items, ``{}`` a map's values)."""
    rule: str
    message: str
    schema: Mapping[str, Any]
    """The schema node the rule is declared on (``self`` has its type)."""
    cardinality: int | None
    """Product of ``maxItems``/``maxProperties`` of the lists and maps above it; None when one has none."""


@dataclass(frozen=True, slots=True)
class RuleCost:
    rule: Rule
    per_call: int
    """Estimated cost of one evaluation."""
    evaluations: int
    """The most values the rule can run on in one object."""

    @property
    def total(self) -> int:
        return self.per_call * self.evaluations


def rules(schema: Mapping[str, Any]) -> list[Rule]:
    """Every rule of a structural schema, outermost first."""
    return list(_walk_rules(schema, "", 1))


def _walk_rules(schema: Mapping[str, Any], location: str, cardinality: int | None) -> Iterator[Rule]:
    for entry in schema.get("x-kubernetes-validations") or ():
        if "messageExpression" in entry:  # its cost depends on string sizes, which the estimate does not model
            raise ValueError(f"{location or '<root>'}: messageExpression is not supported; use message")
        yield Rule(location or "<root>", entry["rule"], entry.get("message", ""), schema, cardinality)
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk_rules(sub, f"{location}.{name}" if location else name, cardinality)
    if isinstance(schema.get("items"), Mapping):
        limit = schema.get("maxItems")
        yield from _walk_rules(schema["items"], f"{location}[]",
                               None if cardinality is None or limit is None else cardinality * int(limit))
    if isinstance(schema.get("additionalProperties"), Mapping):
        limit = schema.get("maxProperties")
        yield from _walk_rules(schema["additionalProperties"], f"{location}{{}}",
                               None if cardinality is None or limit is None else cardinality * int(limit))


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


def evaluate(schema: Mapping[str, Any], value: Any, path: str = "") -> list[Failure]:
    """Every rule of ``schema`` that ``value`` breaks ([] when none), outermost first."""
    failures: list[Failure] = []
    _check(schema, value, path, failures)
    return failures


def _check(schema: Mapping[str, Any], value: Any, path: str, failures: list[Failure]) -> None:
    if value is None:
        return
    for entry in schema.get("x-kubernetes-validations") or ():
        rule, message = entry["rule"], entry.get("message") or f"failed rule: {entry['rule']}"
        try:
            result = _program(rule).evaluate({"self": to_cel(value, schema)})
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
                _check(child, sub, f"{path}.{key}" if path else key, failures)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{i}]", failures)


# --------------------------------------------------------------------------- cost


def expression_cost(expression: str) -> int:
    """cel-go's static cost estimate of one evaluation of ``expression`` (see the module docstring)."""
    return _cost(_ENV.compile(expression))


def estimate(schema: Mapping[str, Any]) -> list[RuleCost]:
    """The estimated cost of every rule of a CRD's schema, as the API server computes it when the CRD is applied."""
    out = []
    for rule in rules(schema):
        per_call = expression_cost(rule.rule)
        evaluations = rule.cardinality if rule.cardinality is not None else \
            MAX_REQUEST_SIZE_BYTES // (min_serialized_size(rule.schema) + 1)
        out.append(RuleCost(rule, per_call, evaluations))
    return out


def min_serialized_size(schema: Mapping[str, Any]) -> int:
    """The fewest JSON bytes a value of ``schema`` takes (required fields without a default count; the API
    server's ``estimateMinSizeJSON``)."""
    kind = schema.get("type")
    if kind == "boolean":
        return 4
    if kind in ("number", "integer"):
        return 1
    if kind == "string":
        return {"date": 12, "date-time": 22}.get(schema.get("format", ""), 2)
    if kind == "array":
        return 2
    if kind == "object":
        size = 2
        props = schema.get("properties") or {}
        for name in schema.get("required") or ():
            prop = props.get(name)
            if prop is not None and "default" not in prop:
                size += len(name) + min_serialized_size(prop) + 4
        return size
    return 1


def _cost(node: Tree | Token) -> int:
    if isinstance(node, Token):
        return 0
    kind, children = node.data, node.children
    if kind == "expr" and len(children) == 3:  # c ? a : b
        return _cost(children[0]) + max(_cost(children[1]), _cost(children[2]))
    if kind in ("conditionalor", "conditionaland") and len(children) == 2:
        return _cost(children[0]) + _cost(children[1])
    if kind in ("relation", "addition", "multiplication") and len(children) == 2:
        operator = children[0]
        assert isinstance(operator, Tree), operator
        return 1 + sum(_cost(c) for c in operator.children) + _cost(children[1])
    if kind == "unary" and len(children) == 2:
        return 1 + _cost(children[1])
    if kind in ("ident", "dot_ident"):
        return 1
    if kind == "member_dot":
        return 1 + _cost(children[0])
    if kind == "member_index":
        return 1 + _cost(children[0]) + _cost(children[1])
    if kind in ("member_dot_arg", "ident_arg", "dot_ident_arg"):
        name = next(str(c) for c in children if isinstance(c, Token))
        if name in _MACROS:
            raise ValueError(f"the cost of the macro {name}() depends on list sizes; the estimate does not model it")
        args = [c for c in children if isinstance(c, Tree)]
        if kind == "ident_arg" and name == "has":  # a presence test: the operand plus 1
            return _cost(args[0])
        return 1 + sum(_cost(a) for a in args)
    if kind == "literal":
        return 0
    if kind == "list_lit":
        return 10 + sum(_cost(c) for c in children)
    if kind == "map_lit":
        return 30 + sum(_cost(c) for c in children)
    return sum(_cost(c) for c in children)


def worst(costs: list[RuleCost]) -> RuleCost | None:
    return max(costs, key=lambda c: c.total, default=None)


def within_limits(costs: list[RuleCost]) -> list[str]:
    """Why the API server would refuse these rules ([] when it takes them)."""
    problems = [f"{c.rule.location}: rule {c.rule.rule!r} costs {c.per_call} per call, over the per-call limit "
                f"{PER_CALL_COST_LIMIT}" for c in costs if c.per_call > PER_CALL_COST_LIMIT]
    problems += [f"{c.rule.location}: rule {c.rule.rule!r} is estimated at {c.total} ({c.per_call} x {c.evaluations} "
                 f"evaluations), over {PER_EXPRESSION_COST_LIMIT}" for c in costs if c.total > PER_EXPRESSION_COST_LIMIT]
    total = sum(c.total for c in costs)
    if total > CRD_COST_LIMIT:
        problems.append(f"the CRD's rules are estimated at {total} together, over {CRD_COST_LIMIT}")
    return problems


__all__ = ["Failure", "Rule", "RuleCost", "rules", "evaluate", "to_cel", "estimate", "expression_cost", "min_serialized_size",
           "within_limits", "worst"]
