"""Human-readable quantities for messages, tables and logs."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``; exact below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
               "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``'512Mi'``, ``'2GiB'``, ``'1.5G'``, ``'4096'`` -> bytes (binary units for K/M/G/T and Ki/Mi/...;
    KB/MB/GB are decimal). Raises ValueError with the accepted forms."""
    s = str(text).strip().lower().replace(" ", "")
    if s.endswith("i"):  # Kubernetes quantity style: Mi, Gi
        s += "b"
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value < 0:
        raise ValueError(f"{text!r} is not a size: use bytes or a number with K/M/G/T, Ki/Mi/Gi/Ti or KB/MB/GB/TB")
    return int(value * _SIZE_UNITS[unit])
