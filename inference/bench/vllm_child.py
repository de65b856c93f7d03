"""The offline benchmark's workload through vLLM, run by another environment's interpreter.

``python vllm_child.py IN.json OUT.json``: IN holds the model folder, dtype, torch threads, repeats and
the requests (prompt token ids, output length); OUT gets the best run's seconds and output tokens, and
vLLM's version. Greedy, ``ignore_eos``, every request submitted at once, as the engine's path. This file
imports only the standard library and vLLM: the environment that runs it need not have this project.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_child.py IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as source:
        job = json.load(source)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    if job.get("num_threads"):
        os.environ.setdefault("OMP_NUM_THREADS", str(job["num_threads"]))
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    if job.get("num_threads"):
        torch.set_num_threads(int(job["num_threads"]))
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=0, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in job["requests"]]
    params = [SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
              for r in job["requests"]]
    warmup = [{"prompt_token_ids": r["prompt"][:16]} for r in job["requests"][:2]]
    llm.generate(warmup, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(int(job["repeats"])):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        runs.append({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    best = min(runs, key=lambda r: r["seconds"])
    result = {"version": vllm.__version__, "seconds": best["seconds"], "tokens": best["tokens"], "runs": runs}
    with open(argv[2], "w", encoding="utf-8") as out:
        json.dump(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
