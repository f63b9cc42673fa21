"""What the execution plan decided, and why: the typed record that ``exl3 inspect --plan`` prints."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_LAYER = re.compile(r"^layer (\d+)(.*)$", re.DOTALL)


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


def _span(first: int, last: int) -> str:
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def _layers(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    if len(runs) == 1:
        return _span(*runs[0])
    return "layers " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def merge_layer_runs(items: Sequence[str]) -> list[str]:
    """``items`` with the ``"layer N<rest>"`` entries that share ``<rest>`` written once, where the first of them
    stood, as ``"layers A-B, C<rest>"``; other entries as they are. Keeps a 30-layer report to one line where
    every layer says the same."""
    groups: dict[str, list[int]] = {}
    order: list[str | tuple[str]] = []  # plain entries, and (rest,) where a group is printed
    for item in items:
        m = _LAYER.match(item)
        if m is None:
            order.append(item)
            continue
        rest = m.group(2)
        if rest not in groups:
            groups[rest] = []
            order.append((rest,))
        groups[rest].append(int(m.group(1)))
    return [e if isinstance(e, str) else _layers(groups[e[0]]) + e[0] for e in order]


def compact_report(parts: Sequence[PartReport]) -> list[str]:
    """Text lines of ``parts`` for a reader: reasons that repeat per layer merged (:func:`merge_layer_runs`), and
    consecutive layers whose decisions are all the same printed once under ``layers A-B (kind)``."""
    runs: list[tuple[int, int, PartReport]] = []  # first layer, last layer (-1: not a layer), merged report
    for part in parts:
        merged = PartReport(part.part, part.kind,
                            [Decision(d.name, d.taken, tuple(merge_layer_runs(d.why))) for d in part.decisions])
        m = _LAYER.match(part.part)
        i = int(m.group(1)) if m and not m.group(2) else -1  # a part named exactly "layer N"
        prev = runs[-1] if runs else None
        if (i >= 0 and prev is not None and prev[1] == i - 1 and prev[2].kind == merged.kind
                and prev[2].decisions == merged.decisions):
            runs[-1] = (prev[0], i, prev[2])
        else:
            runs.append((i, i, merged))
    out: list[str] = []
    for first, last, rep in runs:
        name = rep.part if first < 0 else _span(first, last)
        out += PartReport(name, rep.kind, rep.decisions).lines()
    return out
