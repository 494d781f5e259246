"""Line prices, customer discounts and tax. All amounts are integer cents."""

from __future__ import annotations

from catalog import lookup

TAX_RATE_PERCENT = 10

DISCOUNT_PERCENT = {
    "retail": 0,
    "member": 5,
    "wholesale": 15,
}


def discount_percent(tier: str) -> int:
    if tier not in DISCOUNT_PERCENT:
        raise ValueError(f"unknown customer tier {tier!r}")
    return DISCOUNT_PERCENT[tier]


def apply_discount(amount_cents: int, tier: str) -> int:
    """The amount after the tier's discount, rounded down to whole cents."""
    return amount_cents * (100 - discount_percent(tier)) // 100


def line_price(sku: str, quantity: int, tier: str) -> int:
    """Price of one order line."""
    if quantity <= 0:
        raise ValueError(f"quantity must be positive, got {quantity}")
    gross = lookup(sku).unit_cents * quantity
    return apply_discount(gross, tier)


def tax(amount_cents: int) -> int:
    """Tax on an amount, rounded down to whole cents."""
    return amount_cents * TAX_RATE_PERCENT // 100
