"""The embedded AFD deployment: a tiny deterministic MoE model and its launcher.

See docs/internals/reference.md, "afd_mrv2.reference".
"""
