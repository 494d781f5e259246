"""A plain-text invoice for an order."""

from __future__ import annotations

from catalog import lookup
from orders import Order
from pricing import line_price, tax


def cents(amount: int) -> str:
    return f"{amount // 100}.{amount % 100:02d}"


def invoice(order: Order) -> str:
    rows = [f"Invoice for order {order.number} ({order.tier})"]
    for sku, quantity in order.lines:
        item = lookup(sku)
        price = line_price(sku, quantity, order.tier)
        rows.append(f"  {quantity:>3} x {item.name:<12} {cents(price):>9}")
    discounted = order.discounted()
    rows.append(f"  {'discount':<18} {cents(order.subtotal() - discounted):>9}")
    rows.append(f"  {'tax':<18} {cents(tax(discounted)):>9}")
    rows.append(f"  {'total':<18} {cents(order.total()):>9}")
    return "\n".join(rows)


if __name__ == "__main__":
    demo = Order(1187, "wholesale")
    demo.add("PEN-01", 3)
    demo.add("NOTE-A5", 2)
    print(invoice(demo))
