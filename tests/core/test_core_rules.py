"""Enforced rules of the core (design 2.7): no family names, no plugin imports, one settings
module for EXL3_* variables, and file size budgets."""
from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "exl3_core"
FAMILIES = ("llama", "qwen", "deepseek", "gemma", "mistral", "mixtral", "smollm", "falcon", "phi3", "phi-3",
            "olmo", "granite", "cohere", "exaone", "internlm", "baichuan", "chatglm", "minicpm")
# The only allowed mentions are names of formats and projects, not model families: the
# llama.cpp project and its token types, the ExLlama engines, HF's "llama3" RoPE scaling type,
# and (in the GGUF tokenizer reader only) the GGUF tokenizer-model id "llama" (= SentencePiece).
ALLOWED = re.compile(r"llama\.cpp|llama3|llama_cpp|llama_token_type|exllama", re.IGNORECASE)
PER_FILE_ALLOWED = {"gguf_tokenizer.py": re.compile(r"[\"']llama[\"']")}
FAMILY_RE = re.compile("|".join(re.escape(f) for f in FAMILIES), re.IGNORECASE)


def _py_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_contains_no_family_names() -> None:
    offenders = []
    for p in _py_files():
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            clean = ALLOWED.sub("", line)
            if p.name in PER_FILE_ALLOWED:
                clean = PER_FILE_ALLOWED[p.name].sub("", clean)
            if FAMILY_RE.search(clean):
                offenders.append(f"{p.relative_to(CORE.parent)}:{i}: {line.strip()}")
    assert not offenders, "model-family names belong in plugins:\n" + "\n".join(offenders)


def test_core_never_imports_plugins() -> None:
    offenders = []
    for p in _py_files():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n.split(".")[0].startswith(("exl3_arch_", "exl3_attn_", "exl3_filter")):
                    offenders.append(f"{p.relative_to(CORE.parent)}: imports {n}")
    assert not offenders, "\n".join(offenders)


def test_env_vars_read_only_in_settings() -> None:
    pat = re.compile(r"""(os\.environ|os\.getenv|environ\.get)[^\n]*["']EXL3_""")
    offenders = [str(p.relative_to(CORE.parent)) for p in _py_files()
                 if p.name != "settings.py" and pat.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"read EXL3_* variables through exl3_core.settings only: {offenders}"


def test_every_env_var_is_documented_in_settings() -> None:
    from exl3_core import settings

    doc = settings.__doc__ or ""
    src = Path(settings.__file__).read_text(encoding="utf-8")
    used = set(re.findall(r'g\("([A-Z_]+)"\)|flag\("([A-Z_]+)"', src))
    names = {a or b for a, b in used}
    assert names, "settings.py reads no variables?"
    for n in names:
        assert f"EXL3_{n}" in doc, f"EXL3_{n} is read but not documented in the settings docstring"


def test_file_size_budget() -> None:
    too_big = [f"{p.relative_to(CORE.parent)} ({n} lines)" for p in _py_files()
               if (n := len(p.read_text(encoding='utf-8').splitlines())) > 1000]
    assert not too_big, f"split these by concept: {too_big}"


def _module_name(p: Path) -> str:
    parts = p.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the exl3_core modules it imports anywhere in its source (top level, functions and
    TYPE_CHECKING blocks alike: a type-only import is an edge too). An import of a package's attribute
    that is itself a module (``from exl3_core import ops``) points at that module."""
    mods = {_module_name(p): p for p in _py_files()}

    def resolve(cur: str, node: ast.Import | ast.ImportFrom) -> list[str]:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                pkg = cur.split(".")
                if mods[cur].name != "__init__.py":
                    pkg = pkg[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        out = []
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n:
                out.append(n)
        return out

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in resolve(m, node):
                    # a module importing its own package (or itself) is not a circle between modules
                    if t != m and not m.startswith(t + "."):
                        graph[m].add(t)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles() -> None:
    circles = _circles(_import_graph())
    assert not circles, "import circles in exl3_core (move the shared names down a layer):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(g) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


REPO = CORE.parent


def _sources(*roots: str, exts: tuple[str, ...] = (".py",)) -> list[Path]:
    out: list[Path] = []
    for r in roots:
        out += [p for p in (REPO / r).rglob("*") if p.suffix in exts and "__pycache__" not in p.parts]
    return sorted(out)


def test_no_method_identity_checks() -> None:
    """Fast paths are chosen by the execution plan from module types it knows, never by comparing a
    subclass's method with the base class's (a subclass would silently lose or wrongly keep them)."""
    pat = re.compile(r"type\([^)]*\)\.[a-z_]+ is ")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in _sources("exl3_core", "plugins")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pat.search(line)]
    assert not hits, hits


def test_code_cites_no_runs_or_sessions() -> None:
    """Comments say why; measurements and their history live in docs/ and git, not in the code."""
    pat = re.compile(r"\b(run|session)s? [0-9]", re.IGNORECASE)
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for p in _sources("exl3_core", "plugins", "csrc", exts=(".py", ".cu", ".cuh", ".cpp", ".h"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pat.search(line)]
    assert not hits, "\n".join(hits)


def test_performance_page_is_a_user_page() -> None:
    assert len((REPO / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()) <= 300
