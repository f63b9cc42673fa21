"""What the execution plan decided, and why: the typed record that ``exl3 inspect --plan`` prints."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decision:
    """One choice: a fusion or fast path, whether it is taken, and the reasons when it is not (or the
    conditions under which it is)."""

    name: str
    taken: bool
    why: tuple[str, ...] = ()

    def line(self) -> str:
        mark = "yes" if self.taken else "no "
        return f"{mark} {self.name}" + (f": {'; '.join(self.why)}" if self.why else "")


def decide(name: str, reasons: list[str], when: str = "") -> Decision:
    """A decision taken when ``reasons`` is empty (``when`` then says under which runtime conditions)."""
    if reasons:
        return Decision(name, False, tuple(reasons))
    return Decision(name, True, (when,) if when else ())


@dataclass
class PartReport:
    """The decisions about one part of the model (a block, the embedding, the head)."""

    part: str
    kind: str
    decisions: list[Decision] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"{self.part} ({self.kind})"]
        out += [f"    {d.line()}" for d in self.decisions]
        return out
