"""The item catalog: sku -> (name, unit price in cents), loaded from data/prices.csv."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PRICES = Path(__file__).parent / "data" / "prices.csv"


@dataclass(frozen=True)
class Item:
    sku: str
    name: str
    unit_cents: int


@cache
def load_catalog(path: Path = PRICES) -> dict[str, Item]:
    """Read the price list once; a bad row raises with its line number."""
    items: dict[str, Item] = {}
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            try:
                item = Item(row["sku"], row["name"], int(row["unit_cents"]))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: bad row {row!r}") from exc
            items[item.sku] = item
    return items


def lookup(sku: str) -> Item:
    catalog = load_catalog()
    if sku not in catalog:
        raise KeyError(f"unknown sku {sku!r}; known: {sorted(catalog)}")
    return catalog[sku]
