"""Small MoE checkpoints made here: config.json, a locally built tokenizer and seeded safetensors.

``afd-mrv2 make-model DIR --arch {mixtral,deepseek_v2,qwen2_moe} [--size {tiny,bench}]``.

See docs/internals/reference.md, "afd_mrv2.checkpoints".
"""
