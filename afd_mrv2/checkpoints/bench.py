"""Per-layer compute of a checkpoint's two AFD sides at the bench load, on one core (torch or vLLM's kernels).

:func:`measure_layer_compute`, :data:`BENCH_LOAD`, :data:`HALF_MAX`, :data:`BALANCE_MAX`;
the measured numbers are in docs/benchmarks-vllm.md, "The bench checkpoint".

See docs/internals/reference.md, "afd_mrv2.checkpoints.bench".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from afd_mrv2.checkpoints import bench_torch, bench_vllm
from afd_mrv2.checkpoints.archs import (
    ModelShape,
)
from afd_mrv2.errors import ConfigError
from afd_mrv2.table import format_table

#: A side's half-batch compute must be at most this fraction of its full-batch compute.
HALF_MAX = 0.6
#: The two sides' half-batch computes must be within this factor of each other.
BALANCE_MAX = 1.5
KERNELS = ("auto", "torch", "vllm")


@dataclass(frozen=True)
class BenchLoad:
    """The decode step measured: ``seqs`` sequences, one new token each, with prompts of
    ``prompt_min``..``prompt_max`` tokens (drawn per sequence) and ``decoded`` tokens decoded so far."""

    seqs: int = 64
    prompt_min: int = 16
    prompt_max: int = 32
    decoded: int = 96

    def contexts(self, generator: torch.Generator) -> torch.Tensor:
        """Each sequence's context length (its KV entries, the new token's included)."""
        prompts = torch.randint(self.prompt_min, self.prompt_max + 1, (self.seqs,), generator=generator)
        return prompts + self.decoded


#: 64 concurrent decoding sequences, prompts of 16-32 tokens, 96 tokens into decoding: a mean
#: context of about 120 (the middle of a 192-token generation).
BENCH_LOAD = BenchLoad()


@dataclass(frozen=True)
class SideCompute:
    """One side's per-layer compute (ms, median) for the full batch and for its first half."""

    side: str
    full_ms: float
    half_ms: float

    @property
    def half_ratio(self) -> float:
        return self.half_ms / self.full_ms if self.full_ms > 0 else math.inf

    @property
    def half_ok(self) -> bool:
        return self.half_ratio <= HALF_MAX


@dataclass(frozen=True)
class LayerCompute:
    """What :func:`measure_layer_compute` measured: ``A``/``a`` (attention) and ``F``/``f`` (FFN)."""

    arch: str
    attention: SideCompute
    ffn: SideCompute
    tokens: int
    half_tokens: int
    mean_context: float
    layers: int
    repeats: int
    #: which kernels measured each side: "torch" (the emulation) or "vllm" (vLLM's CPU ops)
    kernels: dict[str, str]
    #: why torch measured a side that ``kernels="auto"`` would have given to vLLM, else ""
    kernels_note: str = ""

    @property
    def balance(self) -> float:
        """``a / f``: the half-batch attention compute over the half-batch FFN compute."""
        return self.attention.half_ms / self.ffn.half_ms if self.ffn.half_ms > 0 else math.inf

    @property
    def balance_ok(self) -> bool:
        return 1 / BALANCE_MAX <= self.balance <= BALANCE_MAX

    @property
    def ok(self) -> bool:
        return self.attention.half_ok and self.ffn.half_ok and self.balance_ok

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the four numbers per side, the ratios and the verdicts."""
        sides = {
            s.side: {**asdict(s), "half_ratio": round(s.half_ratio, 4), "half_ok": s.half_ok}
            for s in (self.attention, self.ffn)
        }
        return {
            "arch": self.arch,
            "tokens": self.tokens,
            "half_tokens": self.half_tokens,
            "mean_context": self.mean_context,
            "layers": self.layers,
            "repeats": self.repeats,
            "threads": 1,
            "kernels": dict(self.kernels),
            "kernels_note": self.kernels_note,
            **sides,
            "a_over_f": round(self.balance, 4),
            "balance_ok": self.balance_ok,
            "criteria": {"half_max": HALF_MAX, "balance_max": BALANCE_MAX},
            "ok": self.ok,
        }

    def report(self) -> str:
        """The table ``make-model --size bench`` prints."""

        def verdict(ok: bool) -> str:
            return "PASS" if ok else "FAIL"

        rows = [
            [s.side, round(s.full_ms, 3), round(s.half_ms, 3), round(s.half_ratio, 3), verdict(s.half_ok)]
            for s in (self.attention, self.ffn)
        ]
        head = (
            f"per-layer compute on one core ({self.arch}, decode step of {self.tokens} sequences, "
            f"half = {self.half_tokens}, mean context {self.mean_context:.0f}; median of {self.repeats} "
            f"passes over {self.layers} layers; kernels: attention {self.kernels['attention']}, "
            f"ffn {self.kernels['ffn']}{'; ' + self.kernels_note if self.kernels_note else ''}):"
        )
        table = format_table(["side", "full ms", "half ms", "half/full", f"<= {HALF_MAX}"], rows)
        tail = (
            f"a/f = {self.balance:.3f} (attention half / FFN half; within {BALANCE_MAX}x: "
            f"{verdict(self.balance_ok)}); overall: {verdict(self.ok)}"
        )
        return "\n".join([head, table, tail])


def measure_layer_compute(
    shape: ModelShape, load: BenchLoad = BENCH_LOAD, *, repeats: int = 21, seed: int = 0, kernels: str = "auto"
) -> LayerCompute:
    """Measure ``A``, ``a``, ``F`` and ``f`` for ``shape`` at ``load`` (see docs/internals/reference.md).

    ``kernels``: ``"torch"`` (the plain-torch emulation), ``"vllm"`` (vLLM's CPU kernels; a
    :class:`~afd_mrv2.errors.ConfigError` when vLLM cannot run them here) or ``"auto"``
    (vLLM's where they can run, else torch)."""
    shape.check()
    if kernels not in KERNELS:
        raise ConfigError("--kernels", f"expected one of {', '.join(KERNELS)}, got {kernels!r}")
    if load.seqs < 2:
        raise ValueError(f"a bench load needs at least 2 sequences, got {load.seqs}")
    use_vllm, note = _vllm_kernels(shape, kernels)
    generator = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            contexts = load.contexts(generator)
            attention: bench_torch.TorchAttentionSide | bench_vllm.VllmAttentionSide
            ffn: bench_torch.TorchFfnSide | bench_vllm.VllmFfnSide
            if use_vllm and shape.arch != "deepseek_v2":
                attention = bench_vllm.VllmAttentionSide(shape, contexts, generator)
            else:
                attention = bench_torch.TorchAttentionSide(shape, contexts, generator)
            ffn = (
                bench_vllm.VllmFfnSide(shape, load.seqs, generator)
                if use_vllm
                else bench_torch.TorchFfnSide(shape, load.seqs, generator)
            )
            used = {
                "attention": "vllm" if not isinstance(attention, bench_torch.TorchAttentionSide) else "torch",
                "ffn": "vllm" if not isinstance(ffn, bench_torch.TorchFfnSide) else "torch",
            }
            half = load.seqs // 2
            a_full, a_half = _time_pair(lambda: attention.run(load.seqs), lambda: attention.run(half), repeats)
            f_full, f_half = _time_pair(lambda: ffn.run(load.seqs), lambda: ffn.run(half), repeats)
    finally:
        torch.set_num_threads(threads)
    per_layer = 1e3 / shape.layers
    return LayerCompute(
        arch=shape.arch,
        attention=SideCompute("attention", a_full * per_layer, a_half * per_layer),
        ffn=SideCompute("ffn", f_full * per_layer, f_half * per_layer),
        tokens=load.seqs,
        half_tokens=half,
        mean_context=float(contexts.float().mean()),
        layers=shape.layers,
        repeats=repeats,
        kernels=used,
        kernels_note=note,
    )


def _vllm_kernels(shape: ModelShape, kernels: str) -> tuple[bool, str]:
    """Whether vLLM's CPU kernels are used for ``kernels`` (``torch``, ``vllm``, ``auto``), and the note saying
    why not (or which part stays the torch emulation)."""
    if kernels == "torch":
        return False, ""
    why = bench_vllm.available()
    if why is not None and kernels == "vllm":
        raise ConfigError("--kernels", f"vllm: {why}")
    if why is None and shape.arch == "deepseek_v2":
        return True, "MLA attention is the torch emulation"
    return why is None, why or ""


def _time_pair(full: Callable[[], object], half: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``full()`` and of ``half()``, interleaved (alternating which goes first)."""
    for _ in range(2):
        full()
        half()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(max(1, repeats)):
        for is_full in (True, False) if i % 2 == 0 else (False, True):
            start = time.perf_counter()
            (full if is_full else half)()
            times[is_full].append(time.perf_counter() - start)
    return _median(times[True]), _median(times[False])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
