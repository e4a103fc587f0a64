"""Direct use of ScheduleSeq1F1B with torch.distributed.pipelining (no torchtitan).

    torchrun --nproc-per-node 2 examples/direct_pipelining.py --steps 20

Each rank builds its stage(s) of a tiny Llama-style model whose attention goes through
seq1f1b.ChunkAwareAttention and whose RoPE reads seq1f1b.current_segment(), then trains it with
Seq1F1B (M samples x K sequence segments per step) on a task that needs the earlier segments:
every sequence counts up by a stride (x[t+1] = x[t] + stride mod V) named only by its first
token, so a later segment must attend back to segment 0 to predict well. The uniform guess
costs ln(V) = 4.85; knowing the current token alone leaves ln(4) = 1.39; attending to the rule
token brings it towards 0. At the end the trained stages are gathered and an unpipelined
forward of the whole model is compared with the pipelined eval() loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ModelShape, ScheduleSeq1F1B, SequenceSplit
from seq1f1b.testing import TinyConfig, build_stages, full_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-chunks", type=int, default=4)
    p.add_argument("--stages-per-rank", type=int, default=1)
    p.add_argument("--split", default="compute", help="uniform | compute | e.g. 96,64,48,48")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )

    cfg = TinyConfig(vocab=128, dim=64, n_heads=4, n_kv_heads=2, n_layers=4 * world, ffn=128)
    num_stages = world * args.stages_per_rank
    mods = build_stages(cfg, num_stages, seed=0)
    mine = list(range(rank, num_stages, world))  # looped placement: stage s on rank s % pp
    stages = [PipelineStage(mods[s].to(device), s, num_stages, device) for s in mine]
    params = [p for s in mine for p in mods[s].parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    split = (
        args.split
        if args.split in ("uniform", "compute")
        else [int(x) for x in args.split.split(",")]
    )
    shape = ModelShape(hidden=cfg.dim, n_heads=cfg.n_heads, n_layers=cfg.n_layers, vocab=cfg.vocab)
    schedule = ScheduleSeq1F1B(
        stages,
        args.microbatches,
        args.seq_chunks,
        loss_fn,
        seq_split=SequenceSplit(split, model_shape=shape, seq_len=args.seq_len),
    )
    if rank == 0:
        print(
            f"pp={world} stages/rank={args.stages_per_rank} M={args.microbatches} "
            f"K={args.seq_chunks} segments={schedule.split_lengths(args.seq_len)}"
        )

    g = torch.Generator().manual_seed(0)
    first_stage, last_stage = 0 in mine, num_stages - 1 in mine
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in stride_batch(args.batch, args.seq_len, cfg.vocab, g))
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(
            *((x,) if first_stage else ()),
            target=y if last_stage else None,
            losses=losses if last_stage else None,
        )
        opt.step()
        if last_stage and (step == 1 or step % 5 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {torch.stack(losses).mean().item():.4f}", flush=True)

    # the same model, unpipelined: every rank gathers the trained stages and compares
    x, y = (t.to(device) for t in stride_batch(args.batch, args.seq_len, cfg.vocab, g))
    losses = []
    with torch.no_grad():
        schedule.eval(
            *((x,) if first_stage else ()),
            target=y if last_stage else None,
            losses=losses if last_stage else None,
        )
        for s in range(num_stages):
            for t in mods[s].state_dict().values():
                dist.broadcast(t, src=s % world)
        if last_stage:
            pipelined = torch.stack(losses).mean().item()
            whole = loss_fn(full_model([m.to(device) for m in mods])(x), y).item()
            agree = abs(pipelined - whole) <= 1e-4 * abs(whole)
            print(
                f"eval loss: pipelined {pipelined:.6f}, unpipelined {whole:.6f} -> "
                + ("agree" if agree else "DIFFER"),
                flush=True,
            )


def stride_batch(
    batch: int, seq_len: int, vocab: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[t+1] = x[t] + stride (mod the first vocab-4 ids); token 0 names the stride (1..4)."""
    n = vocab - 4
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    start = torch.randint(0, n, (batch, 1), generator=g)
    body = (start + stride * torch.arange(seq_len, dtype=torch.int64)) % n
    tokens = torch.cat([n - 1 + stride, body], dim=1)  # rule token ids n .. n+3
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


if __name__ == "__main__":
    try:
        main()
    finally:  # also on failure: a live gloo group at interpreter exit can abort the process
        if dist.is_initialized():
            dist.destroy_process_group()
