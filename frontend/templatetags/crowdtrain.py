"""Template filters: human-readable FLOP counts."""

from __future__ import annotations

from django import template

register = template.Library()

UNITS = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP")


def format_flops(value: float) -> str:
    """1234 -> '1.23 kFLOP', 4.5e12 -> '4.5 TFLOP' (three significant digits, SI prefixes)."""
    number, unit = abs(float(value)), 0
    while unit < len(UNITS) - 1 and float(f"{number:.3g}") >= 1000:
        number, unit = number / 1000, unit + 1
    sign = "-" if float(value) < 0 else ""
    digits = f"{number:,.0f}" if number >= 1000 else f"{float(f'{number:.3g}'):g}"
    return f"{sign}{digits} {UNITS[unit]}"


@register.filter
def flops(value: float | None) -> str:
    return format_flops(value or 0)
