"""Small MoE checkpoints made here: config.json, a locally built tokenizer and seeded safetensors.

``afd-mrv2 make-model DIR --arch {mixtral,deepseek_v2,qwen2_moe} [--size {tiny,bench}]``
writes a model folder vLLM's default loader reads with no download
(``HF_HUB_OFFLINE=1``): ``tiny`` (the default) for the equivalence tests, ``bench``
sized so that micro-batching a 64-sequence decode step can pay, with each AFD side's
per-layer compute measured on one core (:mod:`afd_mrv2.checkpoints.bench`;
docs/benchmarks-vllm.md, "The bench checkpoint").  The
weights are drawn from N(0, 0.08) with a fixed seed: large enough that the model
depends on its routed-expert output (checked against vLLM: replacing it with
zeros changes most greedy tokens), so an AFD == plain-vLLM comparison on it
proves something.  Needs ``safetensors`` and ``tokenizers`` (both come with
vLLM; ``pip install 'afd-mrv2[checkpoints]'`` otherwise).
"""
