"""The one reader of moe_dispatcher's environment variables (the package's and the Megatron integration's).

Every variable is read through one of these helpers, so every variable follows the same rules:
- unset or empty (``VAR=``) means the default;
- surrounding whitespace is ignored; choices and flags are matched case-insensitively;
- anything else that does not parse raises ValueError naming the variable, the value given and what is
  accepted (nothing is silently taken as "on" or as a default).
README.md's settings table lists the variables, their accepted values and defaults.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import TypeVar

_INT = re.compile(r"[+-]?[0-9]+")
_FLAG_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}
_D = TypeVar("_D")


def _raw(name: str) -> str | None:
    """The variable's value stripped of surrounding whitespace; None when unset or empty."""
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _invalid(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not valid: expected {accepted} (or leave {name} unset)")


def _bounds(minimum, greater_than, maximum) -> str:
    parts = []
    if greater_than is not None:
        parts.append(f"> {greater_than}")
    if minimum is not None:
        parts.append(f">= {minimum}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    return " and ".join(parts)


def env_choice(name: str, choices: Sequence[str], default: _D) -> str | _D:
    """One of `choices` (lower-case names), or `default` when unset."""
    value = _raw(name)
    if value is None:
        return default
    chosen = value.lower()
    if chosen not in choices:
        raise _invalid(name, value, f"one of {', '.join(choices)}")
    return chosen


def env_flag(name: str, default: bool = False) -> bool:
    """On: 1, true, yes, on; off: 0, false, no, off; `default` when unset."""
    value = _raw(name)
    if value is None:
        return default
    flag = _FLAG_VALUES.get(value.lower())
    if flag is None:
        raise _invalid(name, value, "1, true, yes or on (on); 0, false, no or off (off)")
    return flag


def env_int(name: str, default: _D, *, minimum: int | None = None,
            maximum: int | None = None) -> int | _D:
    """A decimal integer within [minimum, maximum] (either bound optional), or `default` when unset."""
    value = _raw(name)
    if value is None:
        return default
    number = int(value) if _INT.fullmatch(value) else None
    if (number is None or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)):
        bounds = _bounds(minimum, None, maximum)
        raise _invalid(name, value, "an integer" + (f" {bounds}" if bounds else ""))
    return number


def env_float(name: str, default: _D, *, minimum: float | None = None, greater_than: float | None = None,
              maximum: float | None = None) -> float | _D:
    """A finite number (nan and inf are refused) with minimum <= value, greater_than < value and
    value <= maximum (each bound optional), or `default` when unset."""
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if (not math.isfinite(number) or (minimum is not None and number < minimum)
            or (greater_than is not None and number <= greater_than) or (maximum is not None and number > maximum)):
        bounds = _bounds(minimum, greater_than, maximum)
        raise _invalid(name, value, "a finite number" + (f" {bounds}" if bounds else ""))
    return number


def env_raw(name: str) -> str:
    """The variable's value as the readers see it (stripped; "" when unset or empty), for comparing ranks."""
    return _raw(name) or ""


def differing_setting(name: str, values: Sequence[str], group_name: str) -> ValueError | None:
    """A ValueError naming every rank's value of `name` when the ranks' raw values (env_raw, gathered in rank
    order over `group_name`) differ, for every rank to raise alike; None when they agree."""
    if len(set(values)) <= 1:
        return None
    shown = ", ".join(f"rank {r}: {v!r}" if v else f"rank {r}: unset" for r, v in enumerate(values))
    return ValueError(f"{name} differs between the ranks of {group_name} ({shown}); set it alike on every rank, "
                      "or on none")
