"""Rebuild ``corpus.json.xz``, the built-in calibration / evaluation corpus (see README.md here).

Run from any directory after fetching the Debian packages it reads (Debian 12):

    mkdir /tmp/corpus && cd /tmp/corpus && apt-get download python3.11-doc debian-reference-en \\
        debian-reference-de debian-reference-fr debian-reference-es debian-reference-it \\
        debian-reference-ja debian-reference-zh-cn && for f in *.deb; do dpkg -x $f x; done
    python3 exl3_core/data/calibration/build_corpus.py /tmp/corpus/x

The interpreter that runs it provides the source-code collection (its own standard library) and the
language-reference topics (``pydoc_data.topics``), so use CPython 3.11.7 for an identical file. Every document is cut to ``MAX_CHARS`` characters at a paragraph
boundary so no single long page dominates a collection.
"""
from __future__ import annotations

import json
import lzma
import re
import sys
import sysconfig
from html.parser import HTMLParser
from pathlib import Path

MAX_CHARS = 24_000
PY_DOC_DIRS = ("tutorial", "howto", "faq", "using", "extending", "whatsnew")
DEBREF_LANGS = ("en", "de", "fr", "es", "it", "ja", "zh-cn")
STDLIB_FILES = 40  # modules of 8-40 KB, spread evenly over the sorted list
LICENCES = {
    "python-docs": "PSF-2.0 (Python documentation, CPython 3.11; see LICENSE)",
    "debian-reference": "GPL-2.0-or-later (Debian Reference 2.100, Osamu Aoki and translators; see LICENSE)",
    "python-source": "PSF-2.0 (CPython 3.11 standard library source; see LICENSE)",
    "python-reference": "PSF-2.0 (pydoc_data.topics of CPython 3.11.7; see LICENSE)",
}


class _Text(HTMLParser):
    """Visible text of an HTML page; block elements become paragraph breaks."""

    BLOCK = {"p", "div", "li", "pre", "h1", "h2", "h3", "h4", "h5", "tr", "table", "dt", "dd", "br"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style", "head"):
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head"):
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data)

    def text(self) -> str:
        raw = "".join(self.parts)
        paras = [re.sub(r"[ \t\r\f\v]+", " ", p).strip() for p in re.split(r"\n\s*\n", raw)]
        return "\n\n".join(p for p in paras if p)


def _cut(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    cut = text.rfind("\n\n", 0, MAX_CHARS)
    return text[: cut if cut > MAX_CHARS // 2 else MAX_CHARS]


def documents(root: Path) -> list[dict[str, str]]:
    docs: list[dict[str, str]] = []
    src = root / "usr/share/doc/python3.11/html/_sources"
    for d in PY_DOC_DIRS:
        for p in sorted((src / d).glob("*.rst.txt")):
            name = f"python-docs/{d}/{p.name[:-8]}"
            docs.append({"id": name, "unit": name, "collection": "python-docs", "lang": "en", "text": _cut(p.read_text(encoding="utf-8"))})
    ref = root / "usr/share/debian-reference"
    for lang in DEBREF_LANGS:
        for p in sorted(ref.glob(f"*.{lang}.html")):
            parser = _Text()
            parser.feed(p.read_text(encoding="utf-8"))
            chapter = p.name.split(".")[0]
            # a chapter's translations share one unit, so they all land on the same side of the split
            docs.append({"id": f"debian-reference/{chapter}/{lang}", "unit": f"debian-reference/{chapter}",
                         "collection": "debian-reference", "lang": lang, "text": _cut(parser.text())})
    # the language reference topics (what ``help()`` shows), vendored since before this corpus
    from pydoc_data.topics import topics

    for name in sorted(topics):
        docs.append({"id": f"python-reference/{name}", "unit": f"python-reference/{name}",
                     "collection": "python-reference", "lang": "en", "text": topics[name]})
    lib = Path(sysconfig.get_paths()["stdlib"])
    mods = [p for p in sorted(lib.glob("*.py")) if 8_000 <= p.stat().st_size <= 40_000]
    step = max(1, len(mods) // STDLIB_FILES)
    for p in mods[::step][:STDLIB_FILES]:
        docs.append({"id": f"python-source/{p.name}", "unit": f"python-source/{p.name}",
                     "collection": "python-source", "lang": "python", "text": _cut(p.read_text(encoding="utf-8"))})
    return docs


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    docs = documents(Path(sys.argv[1]))
    blob = json.dumps({"source": f"built by build_corpus.py with CPython {sys.version.split()[0]}",
                       "licences": LICENCES, "documents": docs}, ensure_ascii=False, indent=0).encode()
    out = Path(__file__).with_name("corpus.json.xz")
    out.write_bytes(lzma.compress(blob, preset=9 | lzma.PRESET_EXTREME))
    sizes: dict[str, int] = {}
    for d in docs:
        sizes[d["collection"]] = sizes.get(d["collection"], 0) + len(d["text"])
    print(f"{out}: {len(docs)} documents, {sizes}, {out.stat().st_size} bytes compressed")


if __name__ == "__main__":
    main()
