#!/usr/bin/env bash
# Install arctic-inference, which vLLM's suffix decoding (speculative_config {"method": "suffix", ...}) needs, into
# the vLLM venv given as the argument. PyPI has only its source release, so the wheel is built here, in a throwaway
# venv of its own: its build pins protobuf 5.29 (grpcio-tools), which would move the vLLM venv's protobuf, and its
# CMake finds whichever Python comes first on PATH. The wheel then goes into the vLLM venv with --no-deps. Does
# nothing when `import arctic_inference` already works there. Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set; vLLM imports the suffix tree directly.
# usage: .ci/install_arctic_inference.sh VLLM_VENV
set -euo pipefail
VERSION=0.3.0
vllm_venv=${1:?usage: $0 VLLM_VENV (the venv vLLM is installed in)}
vllm_python="$vllm_venv/bin/python"

if "$vllm_python" -c "import arctic_inference" 2> /dev/null; then
    echo "arctic-inference is already importable in $vllm_venv"
    exit 0
fi

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The vLLM venv's Python (the wheel is built for its ABI) and torch version (the build imports torch; the suffix
# tree extension does not link it).
torch_version=$("$vllm_python" -c "import torch; print(torch.__version__.split('+')[0])")
"$vllm_python" -m venv "$work/build"
PATH="$work/build/bin:$PATH"
pip install -q "torch==$torch_version"
pip install -q setuptools wheel cmake ninja nanobind==2.9.2 protobuf==5.29.6 grpcio-tools
pip wheel -q --no-build-isolation --no-deps "arctic-inference==$VERSION" -w "$work/wheels"
"$vllm_python" -m pip install -q --no-deps "$work"/wheels/arctic_inference-*.whl
"$vllm_python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
rm -rf "$work"  # inside the timing: removing the build venv's torch takes a while on a slow disk
echo "arctic-inference $VERSION installed into $vllm_venv in $((SECONDS - start)) s"
