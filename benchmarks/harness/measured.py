"""Measured runs: the same small Llama under each schedule, on real gloo ranks.

Why: the simulator's cost model leaves out everything a CPU adds (kernel efficiency of short
segments, the K/V prefix blocks, Python overhead); only a real run shows what remains.

One process per rank (``torch.multiprocessing`` spawn, gloo over a FileStore). Each rank pins
itself to one core (``os.sched_setaffinity(0, {rank % cpus})``) and runs one thread
(``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), so at pp=2 on 2 cores the ranks do not
fight; at pp=4 they do (two ranks per core), so such settings report memory only.

All schedules of a setting live in the same processes with identical weights and data. Step 0
of each schedule is its warm-up and the memory step (saved-tensor hooks on, see
:mod:`benchmarks.harness.probe`); then the timed steps run in rounds that rotate through the
schedules, so background load drifts over all of them alike. A step's time is the slowest rank's
``perf_counter`` span from a barrier to the end of ``step()``; we report the median.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from seq1f1b import (
    ChunkedLoss,
    ContextParallelConfig,
    MemoryCappedSplit,
    ScheduleBitPipe,
    SequenceSplit,
)
from seq1f1b.attention.context_parallel import comm_stats
from seq1f1b.bitpipe import BitPipeLayout, new_pair_group
from seq1f1b.registry import ScheduleEntry, lookup
from seq1f1b.testing import TinyConfig, build_stages

from .cpu_replay import replay_step_time
from .probe import ActionRecord, ProbedBitPipeStage, ProbedStage, RankProbe, SavedTensorMeter
from .tiny_shape import model_shape

__all__ = ["RunSpec", "Setting", "measure", "model_shape", "packed_documents", "run_split"]

TIMEOUT = timedelta(seconds=600)


@dataclass(frozen=True)
class RunSpec:
    """One schedule to measure: torch's by name, or Seq1F1B with K segments and a split."""

    schedule: str
    seq_chunks: int = 1
    split: str = "compute"
    seq_len: int | None = None  # overrides the setting's (memory-budget runs)
    memory_only: bool = False  # one step, memory only (no timed steps)
    documents: int = 0  # packed documents of about this many tokens (0: one sequence)
    skip_invisible: bool = True  # False: the mask-alone baseline (see ScheduleSeq1F1B)
    cp_prefix: str = "auto"  # with Setting.cp > 1: how segments reach the cached prefix
    memory_cap: float = 1.0  # seq_split="memory_capped": peak allowed, x the uniform split's
    compiled: bool = False  # every block torch.compile'd (fullgraph), as torchtitan does
    loss_chunk_tokens: int = 0  # > 0: head + loss by seq1f1b.ChunkedLoss in chunks of this
    document_ids: tuple[tuple[int, ...], ...] = ()  # given packed documents, one row a sample
    tag: str = ""  # appended to the label (runs that differ only in document_ids or lengths)

    @property
    def entry(self) -> ScheduleEntry:
        return lookup(self.schedule)

    @property
    def label(self) -> str:
        name = self.schedule
        if self.entry.seq_chunked:
            name = f"{self.schedule} K={self.seq_chunks} {self.split}"
        if self.documents:
            name += f", documents ~{self.documents}" + ("" if self.skip_invisible else " mask only")
        if self.cp_prefix != "auto":
            name += f", {self.cp_prefix}"
        if self.split == "memory_capped" and self.memory_cap != 1.0:
            name += f" {self.memory_cap:g}"
        if self.compiled:
            name += ", compiled"
        if self.loss_chunk_tokens:
            name += ", chunked loss"
        if self.tag:
            name += f", {self.tag}"
        return name if self.seq_len is None else f"{name} @{self.seq_len}"

    @property
    def stages_per_rank(self) -> int:
        return self.entry.stages_per_rank

    @property
    def replicas(self) -> int:
        """Independent pipelines in the stage id space (BitPipe's two model replicas)."""
        return self.entry.replicas

    def model_stages(self, pp: int) -> int:
        """Stages one copy of the model is cut into (BitPipe: 2*pp, for each replica)."""
        return self.entry.model_stages(pp)


@dataclass(frozen=True)
class Setting:
    """A measured comparison: pipeline size, batch, length, model, and the schedules."""

    pp: int
    microbatches: int
    seq_len: int
    model: TinyConfig
    specs: tuple[RunSpec, ...]
    timed_steps: int = 3  # 0: memory only (e.g. when ranks outnumber cores)
    fresh_processes: bool = False  # one process group per schedule (clean peak RSS)
    keep_trace: bool = True
    cp: int = 1  # context parallelism: pp x cp ranks (pp outer), Seq1F1B schedules only
    # untimed steps of each schedule after its memory step (compiled runs: a first step that
    # checks itself runs the compiled blocks eagerly, so the next one compiles)
    warmup_steps: int = 0

    @property
    def world(self) -> int:
        return self.pp * self.cp


@dataclass
class RunResult:
    """What one rank saw for one schedule."""

    label: str
    step_times_s: list[float] = field(default_factory=list)
    peak_activation_bytes: dict[int, int] = field(default_factory=dict)  # per stage
    peak_activation_rank_bytes: int = 0
    unit_activation_bytes: dict[int, int] = field(default_factory=dict)  # per stage, median
    peak_rss_bytes: int | None = None
    param_bytes: int = 0  # this rank's parameters (BitPipe: two replicas' chunks)
    loss: float | None = None
    kv_peak_bytes: int = 0  # Seq1F1B's cached K/V at its peak (this rank)
    cp_sent_bytes: dict[str, int] = field(default_factory=dict)  # one step's CP ring traffic
    trace: list[dict[str, Any]] = field(default_factory=list)
    step_traces: list[list[dict[str, Any]]] = field(default_factory=list)


def run_split(spec: RunSpec, cfg: TinyConfig, seq_len: int) -> SequenceSplit:
    """The split a run uses; the memory-capped one weighs fp32 activations (what runs here)."""
    if "," in spec.split:  # explicit lengths
        return SequenceSplit(tuple(int(x) for x in spec.split.split(",")), seq_len=seq_len)
    if spec.split == "memory_capped":
        return MemoryCappedSplit(
            model_shape=model_shape(cfg), seq_len=seq_len, memory_cap=spec.memory_cap, dtype_bytes=4
        )
    return SequenceSplit(spec.split, model_shape=model_shape(cfg), seq_len=seq_len)


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _seq_len(setting: Setting, spec: RunSpec) -> int:
    return spec.seq_len or setting.seq_len


def packed_documents(rows: int, seq_len: int, mean: int, seed: int = 0) -> torch.Tensor:
    """Document ids of ``rows`` packed sequences: documents of ``mean/2 .. 3*mean/2`` tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        ids: list[int] = []
        doc = 0
        while len(ids) < seq_len:
            ids += [doc] * rng.randint(max(1, mean // 2), max(1, 3 * mean // 2))
            doc += 1
        out.append(ids[:seq_len])
    return torch.tensor(out)


def _data(setting: Setting, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (setting.microbatches, seq_len + 1)
    tokens = torch.randint(0, setting.model.vocab, shape, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _mesh(rank: int, setting: Setting) -> tuple[int, int, Any, Any]:
    """(pp rank, pp size, pp group, cp group) of this rank in the pp x cp mesh."""
    if setting.cp == 1:
        return rank, setting.pp, None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (setting.pp, setting.cp), mesh_dim_names=("pp", "cp"))
    return rank // setting.cp, setting.pp, mesh["pp"].get_group(), mesh["cp"].get_group()


class _Run:
    """One schedule on this rank: its stages, parameters and a ``step`` on fixed data."""

    def __init__(self, spec: RunSpec, rank: int, world: int, setting: Setting, probe: RankProbe):
        self.spec = spec
        self.result = RunResult(spec.label)
        self.x, self.y = _data(setting, _seq_len(setting, spec))
        self.docs = (
            packed_documents(setting.microbatches, _seq_len(setting, spec), spec.documents)
            if spec.documents
            else (torch.tensor(spec.document_ids) if spec.document_ids else None)
        )
        entry = spec.entry
        if entry.replicas == 2:
            self._bitpipe(rank, world, setting, probe)
            return
        pp_rank, pp, pp_group, cp_group = _mesh(rank, setting)
        n = pp * spec.stages_per_rank
        mods = build_stages(setting.model, n, seed=0)
        if spec.compiled:
            for mod in mods:
                for block in mod.layers:
                    block.compile(fullgraph=True)
        self.mine = entry.stages_of(pp, pp_rank, spec.stages_per_rank)
        cpu = torch.device("cpu")
        stages = [ProbedStage(mods[s], s, n, cpu, probe=probe, group=pp_group) for s in self.mine]
        self.params = [p for s in self.mine for p in mods[s].parameters()]
        self.first, self.last = 0 in self.mine, n - 1 in self.mine
        m = setting.microbatches
        cls = entry.schedule_class()
        loss_fn: Any = _loss_fn
        if spec.loss_chunk_tokens:  # the last stage outputs hidden states; the loss runs the head
            mods[-1].skip_head = True
            loss_fn = ChunkedLoss(mods[-1].head, chunk_tokens=spec.loss_chunk_tokens)
        if entry.seq_chunked:
            self.sched: Any = cls(
                stages,
                m,
                spec.seq_chunks,
                loss_fn,
                seq_split=run_split(spec, setting.model, _seq_len(setting, spec)),
                skip_invisible=spec.skip_invisible,
                context_parallel=ContextParallelConfig(cp_group, spec.cp_prefix),
            )
        else:
            self.sched = cls(stages[0] if entry.single_stage else stages, m, loss_fn=loss_fn)

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def _bitpipe(self, rank: int, world: int, setting: Setting, probe: RankProbe) -> None:
        """Both replicas from the same seeded chunks (so they start identical, as
        ``build_bitpipe_stages`` guarantees by broadcast), probed like the other schedules."""
        if self.spec.loss_chunk_tokens:
            raise ValueError("RunSpec.loss_chunk_tokens: not wired for BitPipe's two heads")
        layout = BitPipeLayout(world)
        chunks = build_stages(setting.model, layout.replica_stages, seed=0)
        self.mine = layout.stages_of(rank)
        cpu = torch.device("cpu")
        stages = [
            ProbedBitPipeStage(
                copy.deepcopy(chunks[layout.chunk(g)]), g, layout.num_stages, cpu, probe=probe
            )
            for g in self.mine
        ]
        self.params = [p for s in stages for p in s.submod.parameters()]
        self.first = self.last = rank in (0, world - 1)  # both ends of both replicas
        self.sched = ScheduleBitPipe(
            stages, setting.microbatches, _loss_fn, pair_group=new_pair_group()
        )

    def step(self) -> float | None:
        x, y = self.x, self.y
        losses: list[torch.Tensor] = []
        docs = {} if self.docs is None else {"document_ids": self.docs}
        self.sched.step(
            *((x,) if self.first else ()),
            target=y if self.last else None,
            losses=losses if self.last else None,
            return_outputs=False,
            **docs,
        )
        for p in self.params:
            p.grad = None
        return torch.stack(losses).mean().item() if losses else None


def _trace(records: list[ActionRecord], spec: RunSpec) -> list[dict[str, Any]]:
    k = spec.seq_chunks if spec.entry.seq_chunked else 1
    out = []
    for r in records:
        m, seg = divmod(r.microbatch, k)
        label = f"{m}.{seg}" if k > 1 else f"{m}"
        out.append(
            {
                "stage": r.stage,
                "kind": r.kind,
                "mb": r.microbatch,
                "unit": label,
                "start": r.start,
                "end": r.end,
                "cpu": r.cpu,
            }
        )
    return out


def _memory_step(run: _Run, probe: RankProbe) -> None:
    meter = SavedTensorMeter(exclude=run.params)
    probe.meter = meter
    probe.unit_bytes = {}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    comm_stats().reset()
    try:
        with meter.active():
            run.result.loss = run.step()
    finally:
        probe.close_forward()
        probe.meter = None
    run.result.unit_activation_bytes = {
        s: int(statistics.median(b)) for s, b in probe.unit_bytes.items() if b
    }
    run.result.cp_sent_bytes = dict(comm_stats().sent)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run.result.peak_activation_bytes = {s: meter.peak.get(s, 0) for s in run.mine}
    run.result.peak_activation_rank_bytes = meter.peak_total
    run.result.param_bytes = run.param_bytes
    run.result.peak_rss_bytes = (rss_after - rss_before) * 1024  # ru_maxrss is in KiB on Linux
    unit_actions = getattr(run.sched, "unit_actions", None)  # Seq1F1B-family schedules
    run.result.kv_peak_bytes = unit_actions.kv_peak_bytes() if unit_actions else 0


def _rank_main(rank: int, world: int, setting: Setting, specs: list[RunSpec]) -> list[RunResult]:
    probe = RankProbe()
    results: dict[int, RunResult] = {}
    timed: list[_Run] = []
    for i, spec in enumerate(specs):
        run = _Run(spec, rank, world, setting, probe)
        dist.barrier()
        probe.clear()
        _memory_step(run, probe)
        if setting.keep_trace and not setting.timed_steps:
            run.result.trace = _trace(probe.records, spec)
        results[i] = run.result
        if not spec.memory_only:
            timed.append(run)
        del run  # memory-only runs free their model right away
    for _ in range(setting.warmup_steps):
        for run in timed:
            dist.barrier()
            run.step()
    for i in range(setting.timed_steps if timed else 0):
        for j in range(len(timed)):
            run = timed[(i + j) % len(timed)]
            dist.barrier()
            probe.clear()
            t0 = time.perf_counter()
            run.step()
            run.result.step_times_s.append(time.perf_counter() - t0)
            run.result.step_traces.append(_trace(probe.records, run.spec))
            if setting.keep_trace and i == setting.timed_steps - 1:
                run.result.trace = run.result.step_traces[-1]
    return [results[i] for i in range(len(specs))]


def _entry(
    rank: int, world: int, store: str, out: str, setting: Setting, specs: list[RunSpec]
) -> None:
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    try:
        results = _rank_main(rank, world, setting, specs)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump([asdict(r) for r in results], f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(setting: Setting, specs: list[RunSpec]) -> list[list[dict[str, Any]]]:
    """Run ``specs`` on ``setting.pp`` fresh rank processes; per rank, per spec results."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        world = setting.world
        mp.spawn(_entry, args=(world, store, tmp, setting, specs), nprocs=world)
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    return per_rank


def _merge(setting: Setting, spec: RunSpec, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's result across ranks: slowest rank per step, memory per stage and rank."""
    times = [max(ts) for ts in zip(*(r["step_times_s"] for r in per_rank), strict=True)]
    median = statistics.median(times) if times else None
    steps = list(zip(*(r["step_traces"] for r in per_rank), strict=True))
    # the replay knows one rank per stage: with CP, per-rank traces are not replayed
    replays = [replay_step_time(t, spec.replicas) for t in steps] if setting.cp == 1 else []
    cpu = [sum(ev["cpu"] for t in traces for ev in t) for traces in steps]
    wall = [sum(ev["end"] - ev["start"] for t in traces for ev in t) for traces in steps]
    seq_len = _seq_len(setting, spec)
    tokens = setting.microbatches * seq_len
    stages: dict[int, int] = {}
    for r in per_rank:
        for s, b in r["peak_activation_bytes"].items():  # CP: a stage's largest rank
            stages[int(s)] = max(stages.get(int(s), 0), int(b))
    units: dict[int, int] = {}
    for r in per_rank:
        for s, b in r["unit_activation_bytes"].items():
            units[int(s)] = max(units.get(int(s), 0), int(b))
    trace = [dict(ev, rank=rank) for rank, r in enumerate(per_rank) for ev in r["trace"]]
    loss = next((r["loss"] for r in per_rank if r["loss"] is not None), None)
    return {
        "label": spec.label,
        "schedule": spec.schedule,
        "seq_chunks": spec.seq_chunks,
        "split": spec.split if spec.entry.seq_chunked else None,
        "pp": setting.pp,
        "cp": setting.cp,
        "microbatches": setting.microbatches,
        "seq_len": seq_len,
        "step_time_s": median,
        "step_time_min_s": min(times) if times else None,
        "replay_step_time_s": statistics.median(replays) if replays else None,
        "replay_step_times_s": replays,
        # wall time of the compute actions over their CPU time: 1.0 = the ranks had their cores
        "action_wall_over_cpu": statistics.median(w / c for w, c in zip(wall, cpu, strict=True))
        if cpu
        else None,
        "step_times_s": times,
        "tokens_per_s": tokens / median if median else None,
        "peak_activation_bytes": [stages[s] for s in sorted(stages)],
        "peak_activation_rank_bytes": [r["peak_activation_rank_bytes"] for r in per_rank],
        # peak / one forward's saved bytes, per stage: units in flight as measured
        "units_in_flight": [
            round(stages[s] / units[s], 2) if units.get(s) else None for s in sorted(stages)
        ],
        "param_bytes_rank": [r["param_bytes"] for r in per_rank],
        "kv_peak_bytes_rank": [r["kv_peak_bytes"] for r in per_rank],
        "cp_sent_bytes_rank": [r["cp_sent_bytes"] for r in per_rank],
        "peak_rss_bytes": (
            [r["peak_rss_bytes"] for r in per_rank] if setting.fresh_processes else None
        ),
        "loss": loss,
        "trace": trace,
        # every timed step's actions, all ranks (the calibration fits on them)
        "step_traces": [
            [dict(ev, rank=rank) for rank, t in enumerate(traces) for ev in t] for traces in steps
        ],
    }


def measure(setting: Setting) -> list[dict[str, Any]]:
    """Run every schedule of ``setting``; one merged result dict per schedule, in order."""
    groups = [[s] for s in setting.specs] if setting.fresh_processes else [list(setting.specs)]
    out: list[dict[str, Any]] = []
    for specs in groups:
        per_rank = _spawn(setting, specs)
        for i, spec in enumerate(specs):
            out.append(_merge(setting, spec, [r[i] for r in per_rank]))
    return out
