"""Does torch's own ``context_parallel`` run on CPU? ``python -m benchmarks.cp.torch_cp_cpu``.

Why: it decides whether our ring attention is needed on CPU at all. Two gloo ranks shard a
sequence with ``torch.distributed.tensor.experimental.context_parallel`` and run a causal SDPA
forward and backward; each rank prints whether it ran or the error torch raised.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _rank(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(1, 2, 16, 8)
    w = torch.randn(8, 8, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q = x @ w
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        result = "ran"
    except Exception as exc:  # the point is to report what torch raises
        result = f"fails: {type(exc).__name__}: {str(exc)[:200]}"
    print(f"rank {rank}, torch {torch.__version__}: context_parallel on CPU {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store")), nprocs=2)
