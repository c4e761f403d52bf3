"""Human-readable quantities for messages, tables and logs."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``; exact below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
