"""Worker: compiled blocks (torchtitan's way: each block, ``fullgraph=True``) under the
Seq1F1B schedules against the eager full-sequence reference, and the compile count."""

from __future__ import annotations

import torch
from equivalence import Case, data, documents, loss_fn, reference, rel_err
from torch.distributed.pipelining import PipelineStage

from seq1f1b.registry import lookup
from seq1f1b.testing import build_stages

# (seq_len, K): lengths that change between steps (segments of 8, 10, 6 tokens), then another K
STEPS = ((24, 3), (30, 3), (18, 3), (24, 2))
MAX_GRAPHS = 6  # a small constant: static, then dynamic lengths; never per segment or step


def compiled_schedule_steps(
    rank: int, world: int, schedule: str, checkpointing: bool, docs: bool
) -> None:
    """Several stages on one rank, every block compiled; each step's loss and every gradient
    equal the eager reference at 1e-5, and the compilations stay bounded."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if lookup(schedule).split_backward:  # a split backward runs a compiled backward twice
        torch._functorch.config.donated_buffer = False
    num_stages = 2
    first = Case(2, 3, 2, seq_len=24, batch=4, checkpointing=checkpointing, docs=docs)
    mods = build_stages(first.cfg, num_stages, checkpointing=checkpointing)
    for mod in mods:
        for block in mod.layers:
            block.compile(fullgraph=True)
    mine = lookup(schedule).stages_of(1, 0, num_stages)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    cls = lookup(schedule).schedule_class()
    scheds = {k: cls(stages, first.n_microbatches, k, loss_fn) for k in {k for _, k in STEPS}}
    for seq_len, k in STEPS:
        case = Case(2, k, 2, seq_len=seq_len, batch=4, checkpointing=checkpointing, docs=docs,
                    schedule=schedule)  # fmt: skip
        ref_loss, ref_grads = reference(case, num_stages)
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        x, y = data(case)
        losses: list[torch.Tensor] = []
        scheds[k].step(x, target=y, losses=losses, document_ids=documents(case))
        assert scheds[k].kv_state_empty()
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
        for s in mine:
            for name, p in mods[s].named_parameters():
                err = rel_err(p.grad, ref_grads[f"{s}.{name}"])
                assert err <= 1e-5, f"{case} stage {s} {name}: rel err {err:.2e}"
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= MAX_GRAPHS, f"{graphs} compiled graphs over {len(STEPS)} steps"


def refuses_split_backward_with_donated_buffers(rank: int, world: int) -> None:
    """ZBSeq1F1B on compiled blocks while donated buffers are on: a ValueError naming the
    setting, at construction (``.compile()`` is lazy: nothing is compiled here)."""
    torch._functorch.config.donated_buffer = True
    mods = build_stages(Case(1, 2, 2).cfg, 1)
    mods[0].layers[0].compile(fullgraph=True)
    stage = PipelineStage(mods[0], 0, 1, torch.device("cpu"))
    try:
        lookup("ZBSeq1F1B").schedule_class()([stage], 2, 2, loss_fn)
    except ValueError as exc:
        assert "donated_buffer = False" in str(exc), exc
    else:
        raise AssertionError("ZBSeq1F1B accepted compiled blocks with donated buffers on")
