"""TTL classes: how long a block lives after it was written or last hit.

Defaults follow DESIGN.md: `agent` traffic 3 days, `chatbot` 7 days. A namespace can be
bound to a class (`namespace_class`), a request can name its own class, and a hit
refreshes a block's expiry to at least `now + ttl(class of the hitting request)`, less a grain
that spares rewriting what a recent hit set: 1 s on the embedded store, TTL / 64 on Redis.
All times are seconds; clocks are injectable (`Clock`) so tests never sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvledger.core.plan import DEFAULT_TTL_DAYS

DAY_S = 86_400.0
DEFAULT_CLASSES: dict[str, float] = {name: days * DAY_S for name, days in DEFAULT_TTL_DAYS.items()}   # DESIGN's 3, 7 d
DEFAULT_CLASS = "chatbot"

Clock = Callable[[], float]  # wall-clock seconds since the epoch (time.time by default)


def wall_clock() -> float:
    return time.time()


@dataclass(frozen=True, slots=True)
class TtlPolicy:
    """TTL seconds per class, and the class of each namespace (unbound namespaces use `default_class`).

    Invariant: every class named by `default_class` and `namespace_class` has a TTL > 0.
    """

    classes: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_CLASSES))
    namespace_class: Mapping[str, str] = field(default_factory=dict)
    default_class: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        for cls, ttl in self.classes.items():
            if not 0 < ttl < math.inf:
                raise ValueError(f"TTL class {cls!r}: the TTL must be a positive finite number of seconds, got {ttl!r}")
        for cls in (self.default_class, *self.namespace_class.values()):
            if cls not in self.classes:
                raise ValueError(f"unknown TTL class {cls!r}; known: {', '.join(sorted(self.classes))}")

    def resolve(self, namespace: str, ttl_class: str | None = None) -> tuple[str, float]:
        """(class, TTL seconds) of a request: its own class if given, else its namespace's, else the default."""
        cls = ttl_class or self.namespace_class.get(namespace, self.default_class)
        try:
            return cls, float(self.classes[cls])
        except KeyError:
            raise ValueError(f"unknown TTL class {cls!r}; known: {', '.join(sorted(self.classes))}") from None

    @classmethod
    def parse(cls, classes: str = "", namespaces: str = "", default_class: str = DEFAULT_CLASS) -> TtlPolicy:
        """From CLI text: classes 'agent=3,chatbot=7' (days), namespaces 'tenantA=agent,tenantB=chatbot'."""
        table = dict(DEFAULT_CLASSES)
        for part in filter(None, (p.strip() for p in classes.split(","))):
            name, _, days = part.partition("=")
            try:
                table[name.strip()] = float(days) * DAY_S
            except ValueError:
                raise ValueError(f"bad TTL class {part!r}; expected NAME=DAYS") from None
        ns_map: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in namespaces.split(","))):
            ns, _, c = part.partition("=")
            if not c:
                raise ValueError(f"bad namespace binding {part!r}; expected NAMESPACE=CLASS")
            ns_map[ns.strip()] = c.strip()
        return cls(classes=table, namespace_class=ns_map, default_class=default_class)
