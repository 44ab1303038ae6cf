"""llama.cpp's side of benchmarks/quantization.py: runs in the venv benchmarks/setup_llamacpp.sh
builds (llama-cpp-python; no torch, no pdserve), on token ids the caller gives, so both engines see
the same inputs.

    .llamacpp-venv/bin/python benchmarks/llamacpp_decode.py INPUT.json OUTPUT.json

INPUT.json: {"model": GGUF path, "threads": N, "decode_prompt": [ids], "decode_tokens": N,
"repeats": N, "ppl_windows": [[ids], ...], "greedy_prompts": [[ids], ...], "greedy_tokens": N,
"extra_bufts": bool}. ``extra_bufts`` false loads the weights without llama.cpp's extra buffer types
(its AMX and repacked-weight matmuls), as ``--no-extra-bufts`` does in llama.cpp's own tools.
OUTPUT.json: load seconds, file MiB, decode tokens/s at batch 1 (the best of the repeats; timed
from the token after the prompt's, as quantization.py times pdserve), perplexity over the windows
(each window's tokens after its first, scored from the model's logits), and the greedy tokens of
each prompt (argmax, end-of-sequence not special).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import llama_cpp.llama_cpp as llama_lib
import numpy as np
from llama_cpp import Llama


def log_softmax_at(logits: np.ndarray, ids: list[int]) -> float:
    """Sum over rows of log p(ids[row]) under softmax(logits[row])."""
    logits = logits.astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return float((logits[np.arange(len(ids)), ids] - lse).sum())


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if not spec.get("extra_bufts", True):
        defaults = llama_lib.llama_model_default_params

        def plain_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_lib.llama_model_default_params = plain_buffers  # what Llama() starts its model params from
    t0 = time.perf_counter()
    longest = max([len(w) for w in spec["ppl_windows"]] + [len(spec["decode_prompt"]) + spec["decode_tokens"], 64])
    llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_ctx=longest + 64, n_batch=max(512, longest), logits_all=True, verbose=False)
    out = {"load_s": time.perf_counter() - t0, "weight_mib": os.path.getsize(spec["model"]) / 2**20,
           "threads": spec["threads"], "version": __import__("llama_cpp").__version__,
           "extra_bufts": spec.get("extra_bufts", True)}

    def greedy(prompt: list[int], tokens: int) -> tuple[list[int], float]:
        llm.reset()
        llm.eval(prompt)
        got = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
        started = time.perf_counter()
        while len(got) < tokens:
            llm.eval([got[-1]])
            got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        return got, (tokens - 1) / (time.perf_counter() - started)

    out["decode_b1_tok_s"] = max(greedy(spec["decode_prompt"], spec["decode_tokens"])[1]
                                 for _ in range(spec["repeats"]))
    nll, count = 0.0, 0
    for window in spec["ppl_windows"]:
        llm.reset()
        llm.eval(window)
        nll -= log_softmax_at(np.asarray(llm.scores[: len(window) - 1]), window[1:])
        count += len(window) - 1
    out["perplexity"], out["ppl_tokens"] = math.exp(nll / count), count
    out["greedy"] = [greedy(p, spec["greedy_tokens"])[0] for p in spec["greedy_prompts"]]
    open(sys.argv[2], "w").write(json.dumps(out))


if __name__ == "__main__":
    main()
