"""One vLLM engine run for tests/vllm (a subprocess per engine: each gets a fresh vLLM).

    python tests/vllm/engine.py MODEL OUT.json [--afd JSON] [--engine-args JSON] [--n 16] [--max-tokens 12]

Builds an offline ``LLM`` on MODEL (fp32, seed 0) with afd-mrv2's worker
extension (methods reachable through ``collective_rpc``; harmless without an
``afd`` section), generates greedily with logprobs for fixed prompts, asks the
worker for its routed-expert parameter bytes, AFD counters and model runner
(``afd_runner_info``: which runner class the worker really holds), and writes
everything as JSON.  ``--engine-args`` adds to or overrides the engine arguments
(e.g. ``enforce_eager``, ``worker_cls`` for the V2 runner).  The environment decides the rest (VLLM_PLUGINS,
VLLM_CPU_OMP_THREADS_BIND, the test-only zero switch, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# run as a script (python tests/vllm/engine.py): its folder is sys.path[0], the repo root (scripts/) is not
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.serving import PROMPTS

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 16, "seed": 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--afd", default=None, help="the afd section (JSON)")
    parser.add_argument("--engine-args", default="{}", help="engine arguments to add or override (JSON)")
    parser.add_argument("--n", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"afd": json.loads(args.afd)}} if args.afd else {}
    start = time.time()
    engine_args = {**ENGINE_ARGS, **json.loads(args.engine_args), **extra}
    llm = LLM(model=args.model, worker_extension_cls="afd_mrv2.mrv2.extension.AfdWorkerExtension", **engine_args)
    started = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    outputs = llm.generate(PROMPTS[: args.n], params)
    generated = time.time()
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]
        results.append({"prompt": output.prompt, "tokens": list(completion.token_ids), "logprobs": logprobs})
    (expert_bytes,) = llm.collective_rpc("afd_routed_expert_bytes")
    (afd_stats,) = llm.collective_rpc("afd_attention_stats")
    (runner_info,) = llm.collective_rpc("afd_runner_info")
    report = {
        "startup_s": started - start,
        "generate_s": generated - started,
        "routed_expert_bytes": expert_bytes,
        "afd_stats": afd_stats,
        "runner_info": runner_info,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"engine.py: startup {started - start:.1f}s generate {generated - started:.1f}s", flush=True)


if __name__ == "__main__":
    main()
