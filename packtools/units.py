"""Human-readable byte counts for logs and reports (binary units, as `ls -h` and `df -h` print)."""

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

GIB = 1 << 30


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; exact bytes below 1 KiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def plain_number(x: float) -> str:
    """1048576 -> '1,048,576', 0.5 -> '0.5', 6553.0 -> '6,553': for ranges in messages."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"
