"""Worker: compiled blocks (torchtitan's way: each block, ``fullgraph=True``) under the
Seq1F1B schedules against the eager full-sequence reference, and the compile count."""

from __future__ import annotations

import functools

import torch
from equivalence import (
    Case,
    _groups,
    data,
    documents,
    loss_fn,
    my_stages,
    reference,
    rel_err,
)
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import seq1f1b
from seq1f1b import ContextParallelConfig, SequenceSplit
from seq1f1b import _runtime as rt
from seq1f1b.registry import lookup
from seq1f1b.testing import build_stages

# (seq_len, K): lengths that change between steps (segments of 8, 10, 6 tokens), then another K
STEPS = ((24, 3), (30, 3), (18, 3), (24, 2))
MAX_GRAPHS = 6  # a small constant: static, then dynamic lengths; never per segment or step


def compiled_schedule_steps(
    rank: int, world: int, schedule: str, checkpointing: bool, docs: bool, hybrid: bool = False
) -> None:
    """Several stages on one rank, every block compiled; each step's loss and every gradient
    equal the eager reference at 1e-5, and the compilations stay bounded (per block kind:
    ``hybrid`` stacks Gated DeltaNet blocks, whose state the compiled op carries)."""
    counters = rt.dynamo_counters()
    torch.compiler.reset()
    counters.clear()
    # on: zero-bubble orders run compiled backwards whole, so a donated buffer is used once
    rt.set_donated_buffers(True)
    num_stages = 2
    first = Case(2, 3, 2, seq_len=24, batch=4, checkpointing=checkpointing, docs=docs,
                 hybrid=hybrid)  # fmt: skip
    mods = build_stages(first.cfg, num_stages, checkpointing=checkpointing)
    for mod in mods:
        for i, block in enumerate(mod.layers):
            if hybrid and checkpointing:  # torchtitan's order: the checkpoint inside the graph
                mod.checkpointing = False  # (a compiled graph may reuse an op's input buffer)
                mod.layers[i] = torch.compile(rt.checkpoint_wrapper(block), fullgraph=True)
            else:
                block.compile(fullgraph=True)
    mine = lookup(schedule).stages_of(1, 0, num_stages)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = lookup(schedule).schedule_class()
    scheds = {k: cls(stages, first.n_microbatches, k, loss_fn) for k in {k for _, k in STEPS}}
    kinds = {a.computation_type for a in scheds[3].pipeline_order[0] if a is not None}
    if lookup(schedule).split_backward:  # a compiled backward is not split (it would run twice)
        assert rt.BACKWARD_WEIGHT not in kinds and rt.FULL_BACKWARD in kinds, kinds
    for seq_len, k in STEPS:
        case = Case(2, k, 2, seq_len=seq_len, batch=4, checkpointing=checkpointing, docs=docs,
                    schedule=schedule, hybrid=hybrid)  # fmt: skip
        ref_loss, ref_grads = reference(case, num_stages)
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        x, y = data(case)
        losses: list[torch.Tensor] = []
        scheds[k].step(x, target=y, losses=losses, document_ids=documents(case))
        assert scheds[k].unit_actions.kv_state_empty()
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
        for s in mine:
            for name, p in mods[s].named_parameters():
                name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
                err = rel_err(p.grad, ref_grads[f"{s}.{name}"])
                assert err <= 1e-5, f"{case} stage {s} {name}: rel err {err:.2e}"
    graphs = counters["stats"]["unique_graphs"]
    kinds = 2 if hybrid else 1
    assert 0 < graphs <= kinds * MAX_GRAPHS, f"{graphs} compiled graphs over {len(STEPS)} steps"


#: compiled PP x CP cases (cp = 2 on two ranks, two stages on the pipeline rank): Seq1F1B with
#: packed documents (cached segments reached by moving the queries), ZBVSeq1F1B's V with a
#: window + sinks, checkpointing and an uneven split (by moving the cached K/V blocks)
CP_CASES = (
    Case(2, 4, 2, cp=2, seq_len=32, batch=4, docs=True, cp_prefix="pass_q"),
    Case(2, 3, 2, cp=2, seq_len=32, batch=4, window=6, sinks=2, checkpointing=True,
         split=(12, 8, 12), schedule="ZBVSeq1F1B", cp_prefix="pass_kv"),
)  # fmt: skip


def compiled_cp_schedule_steps(rank: int, world: int, cases: tuple[Case, ...]) -> None:
    """Context parallelism with every block compiled (``fullgraph=True``: the ring's hops run
    inside the attention's custom ops, so a graph break would fail the compile): each case's
    second step (the first checks itself, eagerly) has the loss (the CP mean) and every
    gradient of the eager full-sequence reference at 1e-5, and of the eager run of the same
    schedule under CP at 1e-6."""
    counters = rt.dynamo_counters()
    torch.compiler.reset()
    counters.clear()
    rt.set_donated_buffers(True)
    for case in cases:
        pp_rank, pp, pp_group, cp_group = _groups(rank, world, case.cp)
        num_stages = pp * case.stages_per_rank
        ref_loss, ref_grads = reference(case, num_stages)
        mine = my_stages(case, pp_rank, pp)
        results = {}
        for compiled in (False, True):
            mods = build_stages(case.cfg, num_stages, checkpointing=case.checkpointing)
            if compiled:
                for mod in mods:
                    for block in mod.layers:
                        block.compile(fullgraph=True)
            dev = torch.device("cpu")
            stages = [PipelineStage(mods[s], s, num_stages, dev, group=pp_group) for s in mine]
            split = case.split if isinstance(case.split, str) else tuple(case.split)
            sched = lookup(case.schedule).schedule_class()(
                stages, case.n_microbatches, case.seq_chunks, loss_fn,
                seq_split=SequenceSplit(split),
                context_parallel=ContextParallelConfig(cp_group, case.cp_prefix),
            )  # fmt: skip
            x, y = data(case)
            last = num_stages - 1 in mine
            # the first step checks itself, compiled stages running eagerly: the second counts
            for _ in range(2 if compiled else 1):
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                sched.step(*((x,) if 0 in mine else ()), target=y if last else None,
                           losses=losses if last else None,
                           document_ids=documents(case))  # fmt: skip
                assert sched.unit_actions.kv_state_empty()
            loss = torch.stack(losses).mean() if last else torch.zeros(())
            torch.distributed.all_reduce(loss, group=cp_group)  # each CP rank's share
            loss = loss.item() / case.cp
            grads = {}
            for s in mine:
                for name, p in mods[s].named_parameters():
                    grads[f"{s}.{name.replace('_orig_mod.', '')}"] = p.grad
            results[compiled] = loss, grads
            if last:
                assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (compiled, case, loss)
            for name, g in grads.items():
                err = rel_err(g, ref_grads[name])
                assert err <= 1e-5, f"compiled={compiled} {case} {name}: rel err {err:.2e}"
        (eager, eager_grads), (comp, comp_grads) = results[False], results[True]
        assert abs(comp - eager) <= 1e-6 * abs(eager), (case, comp, eager)
        for name, g in comp_grads.items():
            assert rel_err(g, eager_grads[name]) <= 1e-6, f"{case} {name}: compiled vs eager"
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


def refuses_compiled_on_some_ranks_only(rank: int, world: int) -> None:
    """ZBSeq1F1B with compiled blocks on rank 0 only: rank 0 would run whole backwards and
    rank 1 split ones, a different order; every rank fails the step's pre-flight, naming the
    fix, before any pipeline traffic (``.compile()`` is lazy: nothing is compiled here)."""
    case = Case(1, 2, 2, schedule="ZBSeq1F1B")
    mods = build_stages(case.cfg, world)
    if rank == 0:
        for block in mods[rank].layers:
            block.compile(fullgraph=True)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = lookup("ZBSeq1F1B").schedule_class()([stage], 2, 2, loss_fn)
    x, y = data(case)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    except ValueError as exc:
        assert "Compile the blocks of every stage" in str(exc), exc
    else:
        raise AssertionError("ZBSeq1F1B ran with compiled blocks on some ranks only")


class _AttentionBlock(nn.Module):
    """A fused Q/K/V projection and the chunk-aware attention (4 heads of 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.attn = seq1f1b.ChunkAwareAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).transpose(1, 2).reshape(1, -1, 32)


def attention_ops_in_backward(
    save: set, device: str, dtype: torch.dtype
) -> tuple[int, int, torch.Tensor]:
    """Calls of the compiled attention's forward and backward ops during the backward of a
    compiled, op-level selectively checkpointed block that saves ``save`` (torchtitan's kind
    of policy), and x's gradient."""
    torch.compiler.reset()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block = _AttentionBlock().to(device=device, dtype=dtype)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    run = torch.compile(
        lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context), fullgraph=True
    )
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x.requires_grad_()
    out = run(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.float().square().sum().backward()
    names = [e.name for e in prof.events()]
    assert x.grad is not None
    return (
        names.count("seq1f1b::segment_attention"),
        names.count("seq1f1b::segment_attention_backward"),
        x.grad,
    )


class _NormedLinear(nn.Module):
    """A block's worth of parameters (a user module: dynamo skips torch's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def fsdp_wider_grads_through_a_recompile(rank: int, world: int, result: str) -> None:
    """A compiled block under FSDP2 with bf16 parameters and fp32 reduction, gradients
    accumulated without reduction (as pipelining does between microbatches), then called on a
    new length (a recompile, ``dynamic=False``). Writes to ``result`` whether FSDP left a
    wider gradient on a parameter and whether the recompile failed without the seam's
    context; raises if it fails inside the context or the hidden gradients come back changed."""
    import json

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    del rank, world
    torch.manual_seed(0)
    inner = _NormedLinear()
    inner.compile(fullgraph=True, backend="eager", dynamic=False)
    block = nn.Sequential(inner)  # FSDP's hooks outside the compiled frame, as torchtitan's
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(block, mp_policy=policy, reshard_after_forward=False)
    block.set_requires_gradient_sync(False)
    block.set_reshard_after_backward(False)
    block(torch.randn(2, 4, 8)).float().sum().backward()
    wider = {
        p: p.grad for p in block.parameters() if p.grad is not None and p.grad.dtype != p.dtype
    }
    outcome = {"wider": bool(wider), "failed_without": False}
    if not wider:
        with open(result, "w") as f:
            json.dump(outcome, f)
        return
    try:
        block(torch.randn(2, 5, 8))
    except rt.dynamo_unsupported() as error:
        outcome["failed_without"] = "dtype mismatch between tensor and its gradient" in str(error)
    kept = {p: g.clone() for p, g in wider.items()}
    with rt.wider_grads_hidden_while_tracing([block]):
        out = block(torch.randn(2, 6, 8))
        assert all(p.grad is g for p, g in wider.items()), "a gradient was not put back"
    for p, g in kept.items():
        assert torch.equal(p.grad, g)
    out.float().sum().backward()  # accumulates onto the gradients put back
    assert all(p.grad.dtype == torch.float32 and not torch.equal(p.grad, kept[p]) for p in kept)
    with open(result, "w") as f:
        json.dump(outcome, f)
