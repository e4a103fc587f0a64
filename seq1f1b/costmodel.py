"""Memory and time of one pipeline stage, per GPU, for the planner.

Why a separate module: the planner searches settings, this module prices one of them, and the
formulas are the part users argue with, so they are stated here in one place.

Memory (bytes per GPU; ``b`` = activation dtype bytes, ``t`` = tensor-parallel degree with
sequence parallelism, so every activation and weight is split ``t`` ways):

* saved activations per token per layer, Llama block (RMSNorm, RoPE, SwiGLU, no dropout, flash
  attention so no score matrix)::

      b * (2H  norm inputs  + 2H  norm outputs  + h*d  Q  + 2*h_kv*d  K, V  + h*d  attention out
           + 4F  gate, up, silu(gate), silu*up)  +  4*h  fp32 log-sum-exp

  (``2F`` instead of ``4F`` for a plain two-matrix FFN); divided by ``t``;
* full activation checkpointing (torchtitan ``mode = "full"``): only each layer's input, ``b*H``
  per token per layer, plus, with ``K > 1`` segments, the K/V of earlier segments that later
  segments read (``2*b*h_kv*d``); the backward of one unit recomputes one layer's activations
  of that unit on top (a transient);
* last stage: fp32 log-probabilities ``4*V`` per token in flight (the loss's saved state), plus
  the transient bf16 logits and their fp32 copy ``6*V`` for the unit being run; divided by ``t``
  (torchtitan's loss-parallel output layer);
* model state: ``state_bytes_per_param`` (16: fp32 weights, gradients and two Adam moments) times
  the stage's parameters, divided by ``t`` and by the FSDP degree; with FSDP two layers' bf16
  weights and gradients are gathered at a time on top;
* a stage's activation peak = peak tokens in flight on the stage (from the simulated schedule)
  times the per-token bytes.

Time (seconds): a unit's FLOPs (:func:`seq1f1b.partition.segment_flops`, causal attention
included) over ``t * flops_per_gpu``; backward = 2 forwards, 3 with full recomputation; plus the
tensor-parallel collectives, not overlapped: 4 per layer per pass (2 all-gathers, 2
reduce-scatters of ``b*H`` per token) each moving ``(t-1)/t`` of its bytes at ``tp_bandwidth``.
FSDP's all-gathers / reduce-scatters are assumed overlapped with compute, pipeline p2p is
ignored (a few MB per unit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import _runtime as rt
from ._runtime import Action
from .partition import ModelShape
from .simulate import FlopsCosts

__all__ = ["PRESETS", "Hardware", "MemoryModel", "TimeModel"]

GB = 1e9

#: Model shapes by name. Llama 3: Meta's published configs (torchtitan's ``llama3_args``);
#: ``paper-7b``: the Seq1F1B paper's 7B (GPT-style FFN of 4H, vocabulary 50304, no GQA).
PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(4096, 32, 32, 128256, ffn_hidden=14336, n_kv_heads=8, gated_ffn=True),
    "llama3-70b": ModelShape(8192, 64, 80, 128256, ffn_hidden=28672, n_kv_heads=8, gated_ffn=True),
    "paper-7b": ModelShape(4096, 32, 32, 50304),
}


@dataclass(frozen=True)
class Hardware:
    """What one GPU offers; defaults are an H100 SXM at a typical 40% of its bf16 peak."""

    gpus: int
    memory_gb: float
    reserve_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    tflops: float = 400.0  # achieved dense bf16 TFLOP/s per GPU
    tp_gbps: float = 300.0  # achieved all-gather / reduce-scatter bandwidth inside a node

    @property
    def budget_bytes(self) -> float:
        return (self.memory_gb - self.reserve_gb) * GB


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per token and per parameter of one stage; formulas in the module docstring."""

    shape: ModelShape
    tp: int = 1
    fsdp: int = 1
    recompute: bool = False
    dtype_bytes: int = 2
    state_bytes_per_param: float = 16.0

    def _full_layer_bytes(self) -> float:
        s, b = self.shape, self.dtype_bytes
        d = s.head_dim
        ffn = (4 if s.gated_ffn else 2) * s.ffn_hidden
        return b * (4 * s.hidden + 2 * s.n_heads * d + 2 * s.n_kv_heads * d + ffn) + 4 * s.n_heads

    def layer_bytes_per_token(self, segmented: bool) -> float:
        """Bytes a layer keeps per token of a unit in flight (``segmented``: K > 1)."""
        if not self.recompute:
            return self._full_layer_bytes() / self.tp
        s, b = self.shape, self.dtype_bytes
        kv = 2 * b * s.n_kv_heads * s.head_dim if segmented else 0
        return (b * s.hidden + kv) / self.tp

    def activation_bytes(
        self, tokens_in_flight: float, unit_tokens: int, layers: int, last: bool, segmented: bool
    ) -> float:
        """Peak activation bytes of a stage with ``layers`` blocks."""
        saved = tokens_in_flight * layers * self.layer_bytes_per_token(segmented)
        transient = unit_tokens * self._full_layer_bytes() / self.tp if self.recompute else 0.0
        if last:
            saved += tokens_in_flight * 4 * self.shape.vocab / self.tp
            transient = max(transient, unit_tokens * 6 * self.shape.vocab / self.tp)
        return saved + transient

    def state_bytes(self, layers: int, first: bool, last: bool) -> float:
        """Model-state bytes of a stage (sharded by TP and FSDP) plus FSDP's gathered layers."""
        s = self.shape
        params = layers * s.params_per_layer + s.vocab * s.hidden * (int(first) + int(last))
        sharded = params * self.state_bytes_per_param / (self.tp * self.fsdp)
        gathered = 2 * 2 * 2 * s.params_per_layer / self.tp if self.fsdp > 1 else 0.0
        return sharded + gathered


@dataclass(frozen=True)
class TimeModel:
    """Seconds of one unit's actions on one GPU: FLOPs over throughput plus TP collectives."""

    hardware: Hardware
    shape: ModelShape
    tp: int
    recompute: bool
    layers_per_stage: int
    dtype_bytes: int = 2

    def _tp_seconds_per_token_pass(self) -> float:
        """TP collectives of one pass (a forward, a backward or a recompute) per token."""
        if self.tp == 1:
            return 0.0
        moved = 4 * self.dtype_bytes * self.shape.hidden * (self.tp - 1) / self.tp
        return self.layers_per_stage * moved / (self.hardware.tp_gbps * GB)

    def tp_comm_share(self, flops: float, tokens: int) -> float:
        """Share of a forward spent in TP collectives (the rest is compute)."""
        compute = flops / (self.tp * self.hardware.tflops * 1e12)
        comm = tokens * self._tp_seconds_per_token_pass()
        return comm / (compute + comm) if compute + comm > 0 else 0.0

    def forward_backward(self, flops: float, tokens: int) -> tuple[float, float]:
        """(forward, full backward) seconds of a unit of ``tokens`` and ``flops`` forward FLOPs
        on this stage (whole model width: divided by ``tp`` here)."""
        compute = flops / (self.tp * self.hardware.tflops * 1e12)
        comm = tokens * self._tp_seconds_per_token_pass()
        if self.recompute:
            return compute + comm, 3 * compute + 2 * comm
        return compute + comm, 2 * compute + comm

    def cost(self, costs: FlopsCosts) -> Callable[[Action], float]:
        """A :func:`seq1f1b.simulate.simulate` cost callback in seconds for ``costs``' units."""
        k = len(costs.lengths)
        per_unit = [
            self.forward_backward(f, n)
            for f, n in zip(costs.segment_costs, costs.lengths, strict=True)
        ]

        def seconds(a: Action) -> float:
            fwd, bwd = per_unit[(a.microbatch_index or 0) % k]
            if a.computation_type == rt.FORWARD:
                return fwd
            return bwd if a.computation_type == rt.FULL_BACKWARD else bwd / 2

        return seconds
