"""Device time of fake-tensor ops on a named GPU: a roofline per op, priced with the planner's
GPU profiles, so the dry run's step time and the planner's speak of the same GPU.

Each aten op (and each custom op with a FLOP formula: the fused gated delta rule's) costs
``max(FLOPs / (peak * efficiency), bytes / HBM bandwidth)``: FLOPs from
torch's own formulas (:data:`torch.utils.flop_counter.flop_registry`), the efficiency the
profile's fitted fraction for matrix products (``linear``) or attention (``attention``), the
bytes those of the op's tensor inputs and outputs (views move none). torch's formula counts a
causal block as dense; here it is halved, as the causal kernels skip the masked half.
Collectives and pipeline transfers are not priced (the planner prices them); under DTensor the
local ops are counted, as torch's MemTracker counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ... import _runtime as rt
from ..profiles import GpuProfile, profile

__all__ = ["HBM_GBPS", "DeviceTime", "GpuSpec", "gpu_spec"]

#: HBM bandwidth, GB/s (datasheets: A100 SXM4 80GB 2039, H100 SXM5 3350, H200 SXM 4800)
HBM_GBPS = {"a100-80gb": 2039.0, "h100-80gb": 3350.0, "h200": 4800.0}

_aten = torch.ops.aten
#: attention kernels (priced at the profile's attention efficiency) -> index of is_causal
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention: 4,
    _aten._scaled_dot_product_flash_attention_backward: 9,
    _aten._scaled_dot_product_flash_attention_for_cpu: 4,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: 7,
    _aten._scaled_dot_product_efficient_attention: 5,
    _aten._scaled_dot_product_efficient_attention_backward: 10,
}


@dataclass(frozen=True)
class GpuSpec:
    """What the roofline needs of one GPU: its profile and its HBM bandwidth."""

    profile: GpuProfile
    hbm_gbps: float

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def memory_bytes(self) -> float:
        return self.profile.memory_gb * 1e9


def gpu_spec(name: str) -> GpuSpec:
    """The GPU called ``name`` as the planner names it (``--gpu h100-80gb``)."""
    prof = profile(name)
    if name not in HBM_GBPS:
        raise ValueError(f"no HBM bandwidth known for {name!r}: use one of {sorted(HBM_GBPS)}")
    return GpuSpec(prof, HBM_GBPS[name])


def _causal(func: Any, args: tuple, kwargs: dict) -> bool:
    index = _ATTENTION[func._overloadpacket]
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    return bool(args[index]) if len(args) > index else False


def _bytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class DeviceTime(rt.TorchDispatchMode):
    """Adds up the estimated device seconds of every op it sees (``seconds``; ``flops``).
    Enter it inside a :class:`FakeTensorMode`; it computes nothing itself."""

    def __init__(self, gpu: GpuSpec) -> None:
        super().__init__()
        peak = gpu.profile.peak_tflops * 1e12
        eff = gpu.profile.efficiency
        self._linear, self._attention = peak * eff.linear, peak * eff.attention
        self._bandwidth = gpu.hbm_gbps * 1e9
        self.seconds = 0.0
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if rt.is_subclass_dispatch(types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or (func.namespace != "aten" and packet not in flop_registry):
            return out  # moves no bytes (views, ``t.device``); priced custom ops count
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        rate = self._linear
        if packet in _ATTENTION:
            rate = self._attention
            q, k = args[1 if "backward" in packet.__name__ else 0], args[
                2 if "backward" in packet.__name__ else 1
            ]
            if _causal(func, args, kwargs):
                flops *= 1.0 - q.shape[-2] / (2.0 * k.shape[-2])
        moved = _bytes(rt.tree_flatten((args, kwargs))[0]) + _bytes(rt.tree_flatten(out)[0])
        self.flops += flops
        self.seconds += max(flops / rate, moved / self._bandwidth)
        return out
