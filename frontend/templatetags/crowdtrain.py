"""Template filters: human-readable FLOP counts and credit."""

from __future__ import annotations

import math
from typing import Any

from django import template
from django.utils.formats import get_format, number_format

from workers.credit import credit_from_flops

register = template.Library()

UNITS = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP")


def format_flops(value: float) -> str:
    """1234 -> '1.23 kFLOP', 4.5e12 -> '4.5 TFLOP' (three significant digits, SI prefixes; the decimal point
    is the active language's)."""
    number, unit = abs(float(value)), 0
    while unit < len(UNITS) - 1 and float(f"{number:.3g}") >= 1000:
        number, unit = number / 1000, unit + 1
    sign = "-" if float(value) < 0 else ""
    digits = f"{number:,.0f}" if number >= 1000 else f"{float(f'{number:.3g}'):g}".replace(".", _decimal())
    return f"{sign}{digits} {UNITS[unit]}"


def _decimal() -> str:
    return str(get_format("DECIMAL_SEPARATOR"))


@register.filter
def flops(value: float | None) -> str:
    return format_flops(value or 0)


def format_credit(value: float) -> str:
    """Credit (Cobblestones) in the page's language: whole numbers from 100 on, 2 decimals from 1, and three
    significant digits below (a small work unit is worth 0.000116 credit)."""
    number = float(value)
    if number == 0 or not math.isfinite(number):
        return "0"
    magnitude = abs(number)
    places = (
        0 if magnitude >= 100 else 2 if magnitude >= 1 else min(12, 2 - math.floor(math.log10(magnitude)))
    )
    return number_format(round(number, places), decimal_pos=places, use_l10n=True, force_grouping=True)


@register.filter
def credit(value: Any) -> str:
    try:
        return format_credit(float(value or 0))
    except (TypeError, ValueError):
        return "0"


@register.filter
def flops_credit(value: Any) -> str:
    """A FLOP count shown as credit."""
    try:
        return format_credit(credit_from_flops(float(value or 0)))
    except (TypeError, ValueError):
        return "0"
