"""Typed reads from a parsed TOML (or JSON) table, with errors that name the file, the section and the key.

doc = Table(tomllib.loads(text), "profiles/k25-eagle3.toml")
doc.section("decode").number("fixed_s", minimum=0.0)
"""

from __future__ import annotations

import math
from typing import Any

# Marks a key without a default: missing it is an error.
REQUIRED: Any = object()


class ProfileError(ValueError):
    """A profile that cannot be found or does not make sense; the message names the file and the key."""


def check(ok: bool, where: str, rule: str, value: Any) -> None:
    if not ok:
        raise ProfileError(f"{where} {rule}, got {value!r}")


class Table:
    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected a table, got {type(data).__name__}")
        self.data, self.where = data, where

    def section(self, key: str, *, required: bool = True) -> Table:
        if key not in self.data:
            if required:
                raise ProfileError(f"{self.where}: missing [{key}] section")
            return Table({}, f"{self.where} [{key}]")
        return Table(self.data[key], f"{self.where} [{key}]")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is REQUIRED:
            raise ProfileError(f"{self.where}: missing key {key!r}")
        return default

    def text(self, key: str) -> str:
        value = self._get(key, REQUIRED)
        check(isinstance(value, str) and value != "", f"{self.where}: {key}", "must be a non-empty string", value)
        return value

    def opt_text(self, key: str) -> str | None:
        return self.text(key) if key in self.data else None

    def number(self, key: str, default: Any = REQUIRED, minimum: float | None = None) -> float:
        value = self._get(key, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        check(ok, f"{self.where}: {key}", "must be a number", value)
        if minimum is not None:
            check(value >= minimum, f"{self.where}: {key}", f"must be >= {minimum}", value)
        return float(value)

    def int_(self, key: str, default: Any = REQUIRED, minimum: int | None = None) -> Any:
        """An integer; `default=None` makes the key optional (None when absent)."""
        value = self._get(key, default)
        if value is None:
            return None
        check(
            isinstance(value, int) and not isinstance(value, bool), f"{self.where}: {key}", "must be an integer", value
        )
        if minimum is not None:
            check(value >= minimum, f"{self.where}: {key}", f"must be >= {minimum}", value)
        return value

    def list_(self, key: str) -> list[Any]:
        value = self._get(key, REQUIRED)
        check(isinstance(value, list), f"{self.where}: {key}", "must be a list", value)
        return value

    def int_list(self, key: str) -> list[int]:
        values = self.list_(key)
        check(
            all(isinstance(v, int) and not isinstance(v, bool) for v in values),
            f"{self.where}: {key}",
            "must be a list of integers",
            values,
        )
        return values

    def number_list(self, key: str) -> list[float]:
        values = self.list_(key)
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values)
        check(ok, f"{self.where}: {key}", "must be a list of numbers", values)
        return [float(v) for v in values]
