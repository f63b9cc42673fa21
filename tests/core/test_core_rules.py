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
