"""An order: lines of (sku, quantity) for one customer tier, and its total."""

from __future__ import annotations

from dataclasses import dataclass, field

from pricing import apply_discount, line_price, tax


@dataclass
class Order:
    number: int
    tier: str
    lines: list[tuple[str, int]] = field(default_factory=list)

    def add(self, sku: str, quantity: int) -> None:
        self.lines.append((sku, quantity))

    def subtotal(self) -> int:
        """Sum of the line prices."""
        return sum(line_price(sku, quantity, self.tier) for sku, quantity in self.lines)

    def discounted(self) -> int:
        """The subtotal after the customer's discount."""
        return apply_discount(self.subtotal(), self.tier)

    def total(self) -> int:
        """What the customer pays: discounted subtotal plus tax."""
        amount = self.discounted()
        return amount + tax(amount)
