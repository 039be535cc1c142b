"""The one error type for bad settings, and the shared checks behind it.

A `SettingError` names the setting at fault (`setting`), so every front end can point at its own
spelling of it: the strategy's keyword, the Hydra key `pipeline.<setting>`, the plan command.
It is a ValueError, so callers that catch ValueError keep working.
"""

from __future__ import annotations

from typing import Any, Optional


class SettingError(ValueError):
    def __init__(self, message: str, setting: Optional[str] = None):
        super().__init__(message)
        self.setting = setting


def check_count(name: str, value: Any) -> int:
    """An integer >= 1 (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SettingError(f"{name}={value!r}: must be an integer >= 1", name)
    return value


def check_choice(name: str, value: Any, allowed: list[str]) -> str:
    if not isinstance(value, str) or value.lower() not in [a.lower() for a in allowed]:
        raise SettingError(f"{name}={value!r}; allowed values: {allowed}", name)
    return value.lower()
