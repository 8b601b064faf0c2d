"""Name -> implementation registries: a format, head, loss or data source is one entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from specft.common.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = obj
            return obj

        return decorator

    def alias(self, old: str, name: str) -> None:
        """``old`` stays accepted for the entry ``name``: a name configs and caches already
        hold, kept when the entry was renamed."""
        self.register(old)(self._entries[name])

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._entries:
            where = f"{field}: " if field else ""
            raise ConfigError(f"{where}unknown {self.kind} {name!r}; allowed: {', '.join(self.names)}")
        return self._entries[name]

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
