"""vLLM-Ascend adapters: :mod:`.attention` (the routed compute of vllm-ascend's layer as the AFD transfer) and
:mod:`.ffn` (the FFN role computing with vllm-ascend's layer and quant method).

See docs/internals/vllm-roles.md, "afd_mrv2.mrv2.platforms.ascend" and RFC 0005 §3.
"""
