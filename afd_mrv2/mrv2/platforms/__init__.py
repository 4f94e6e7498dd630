"""Platform adapters of the vLLM integration: where a platform's own MoE layer is composed with, not replaced.

One table per role, keyed by the compat decision's platform: :mod:`.attention` (the Attention worker
installs the platform's routed-experts layer) and :mod:`.ffn` (the FFN role's expert compute).  The
adapters themselves live in one subpackage per platform (:mod:`.ascend`).

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms".
"""
