"""Plug-ins by name: Python entry points, or a ``module:function`` spec.

Tenplex finds the parts a deployment may add without editing it through the
entry points of the installed distributions (``importlib.metadata``):

- ``tenplex.layouts``: layout providers (:class:`tenplex.ptc.provider.LayoutProvider`),
  named in a job's layout spec;
- ``tenplex.backends``: cluster backends, as functions that build a scheduler on
  them (``tenplex scheduler serve --backend NAME``).

A distribution registers one in its ``pyproject.toml``::

    [project.entry-points."tenplex.layouts"]
    my-model = "mypackage.layout:my_layout"

A spec with a colon (``mypackage.layout:my_layout``, or ``module:obj.attr``)
names the object directly instead; the module must be importable by the
process that resolves it. Listing the registered names imports nothing; an
object is imported only when its name is resolved.
"""

from __future__ import annotations

import importlib
import re
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from tenplex.errors import InvalidConfig

LAYOUTS = "tenplex.layouts"
BACKENDS = "tenplex.backends"

NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
"""A registered name: lowercase letters, digits, '-', '_' and '.', at most 63 characters."""
SPEC_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
"""``package.module:attribute[.attribute...]``."""
REFERENCE_PATTERN = f"({NAME_PATTERN[1:-1]})|({SPEC_PATTERN[1:-1]})"
"""Either of the two, for schemas (anchor it where the schema language does not)."""

_SPEC = re.compile(SPEC_PATTERN)


def registered(group: str) -> dict[str, EntryPoint]:
    """Name -> entry point of every installed distribution's registrations in ``group`` (nothing imported)."""
    out: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        out.setdefault(ep.name, ep)
    return dict(sorted(out.items()))


def resolve(group: str, reference: str, what: str) -> Any:
    """The object a registered name or a ``module:function`` spec stands for.

    ``what`` names the kind of object in messages ("layout provider"). Every
    failure (unknown name, a module that does not import, a missing attribute)
    is an :class:`InvalidConfig` that says what was tried and what is registered.
    """
    if not isinstance(reference, str) or not reference:
        raise InvalidConfig(f"a {what} is named by a non-empty string, got {reference!r}")
    return _resolve(group, reference, what)


def load_spec(reference: str, what: str) -> Any:
    """The object a ``module:function`` spec names (an :class:`InvalidConfig` naming ``what`` when it cannot)."""
    if not _SPEC.match(reference):
        raise InvalidConfig(f"{what} {reference!r}: a spec is 'package.module:function'")
    module_name, _, attribute = reference.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidConfig(f"{what} {reference!r}: cannot import {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidConfig(f"{what} {reference!r}: {module_name!r} has no {attribute!r}") from None
    return obj


@cache
def _resolve(group: str, reference: str, what: str) -> Any:
    if ":" in reference:  # a spec, not a registered name
        return load_spec(reference, what)
    names = registered(group)
    ep = names.get(reference)
    if ep is None:
        known = ", ".join(names) or "none"
        raise InvalidConfig(f"unknown {what} {reference!r}; registered (entry points {group!r}): {known}; "
                            "or name your own as 'package.module:function'")
    try:
        return ep.load()
    except (ImportError, AttributeError) as exc:
        raise InvalidConfig(f"{what} {reference!r} is registered as {ep.value!r} "
                            f"(by {ep.dist.name if ep.dist else 'an unknown distribution'}), which does not load: "
                            f"{type(exc).__name__}: {exc}") from None
