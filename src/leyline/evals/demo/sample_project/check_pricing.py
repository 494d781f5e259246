"""Hand-written checks of order totals: python check_pricing.py"""

from __future__ import annotations

from orders import Order


def expect(label: str, order: Order, cents: int) -> bool:
    got = order.total()
    ok = got == cents
    print(f"{'ok  ' if ok else 'FAIL'} {label}: total {got}, expected {cents}")
    return ok


def main() -> int:
    results = []
    retail = Order(1, "retail")
    retail.add("PEN-01", 3)
    results.append(expect("check 1, retail pens", retail, 396))
    member = Order(2, "member")
    member.add("NOTE-A5", 2)
    results.append(expect("check 2, member notebooks", member, 836))
    wholesale = Order(1187, "wholesale")
    wholesale.add("PEN-01", 3)
    wholesale.add("NOTE-A5", 2)
    results.append(expect("check 3, wholesale order 1187", wholesale, 1084))
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
