"""The combination grid: the settings users mix, covered pairwise, as torchtitan runs.

Every pair of values of two settings (schedule x parallelism, model x compile, bf16 x
checkpointing, ...) appears in at least one row of :func:`rows`; a row is one PP=2 training
run compared with PP=1 in the same configuration (model, precision, data-parallel degree).
A pair we do not support is in :data:`REFUSED` with the reason the start-up check gives;
:func:`refusal_rows` holds one run for each, which must fail at start-up naming it.

The rows are generated (a greedy covering array, deterministic), not listed, so adding a
value to a factor grows the grid by the runs the new pairs need, and
``tests/test_combination_grid.py`` checks the covering property of what is generated.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

__all__ = ["FACTORS", "REFUSED", "Row", "reference_key", "refusal_rows", "row_args", "rows"]

#: each setting and its values, the first value of each the plain default (BitPipe pipelines
#: whole microbatches: its rows run the split and K as accepted settings it does not use)
FACTORS: dict[str, tuple[str, ...]] = {
    "model": ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_5"),
    "schedule": ("Seq1F1B", "InterleavedSeq1F1B", "ZBSeq1F1B", "ZBVSeq1F1B", "BitPipe"),
    "parallel": ("none", "fsdp", "tp", "cp", "dp_replicate"),
    "compile": ("eager", "compiled"),
    "precision": ("fp32", "bf16"),
    "ac": ("none", "selective", "full"),
    "split": ("uniform", "compute", "explicit"),
    "loss": ("whole", "chunked"),
}

Pair = tuple[tuple[str, str], tuple[str, str]]
Row = dict[str, str]

#: the pairs refused at start-up, with a phrase of the refusal the run must print
REFUSED: dict[Pair, str] = {
    (("schedule", "BitPipe"), ("parallel", "cp")): (
        "BitPipe pipelines whole samples and does not shard them over the cp mesh"
    ),
}


def _pair(a: tuple[str, str], b: tuple[str, str]) -> Pair:
    """``a`` and ``b`` in the factors' order."""
    order = list(FACTORS)
    return (a, b) if order.index(a[0]) < order.index(b[0]) else (b, a)


def pairs_of(row: Row) -> Iterator[Pair]:
    """Every pair of settings in ``row``."""
    for a, b in itertools.combinations(list(FACTORS), 2):
        if a in row and b in row:
            yield (a, row[a]), (b, row[b])


def _allowed(row: Row) -> bool:
    return not any(p in REFUSED for p in pairs_of(row))


def all_pairs() -> set[Pair]:
    """Every pair of values of two factors but the refused ones."""
    out = set()
    for a, b in itertools.combinations(list(FACTORS), 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            if ((a, va), (b, vb)) not in REFUSED:
                out.add(((a, va), (b, vb)))
    return out


def _complete(seed: Row, order: list[str], uncovered: set[Pair]) -> Row:
    """``seed`` filled factor by factor (in ``order``) with the allowed value that covers the
    most uncovered pairs with what is set (ties: the earlier value)."""
    row = dict(seed)
    for name in order:
        if name in row:
            continue
        best, gain = None, -1
        for value in FACTORS[name]:
            trial = {**row, name: value}
            if not _allowed(trial):
                continue
            new = sum(_pair((name, value), (k, v)) in uncovered for k, v in row.items())
            if new > gain:
                best, gain = value, new
        if best is None:
            raise ValueError(f"no allowed value of {name} with {row}")
        row[name] = best
    return row


def _latin_square() -> list[Row]:
    """The first three factors, when the second and third have the same number n of values
    and the first at least n, in n * n rows holding every pair among the second and third and
    the first's first n values (value i, value j, value (i + j) mod n): the fewest rows that
    any covering set of them needs. The first factor's later values (a family added after the
    square, such as qwen3_5) come in the greedy rows after it, so the square's rows stay."""
    a, b, c = list(FACTORS)[:3]
    n = len(FACTORS[b])
    if len(FACTORS[c]) != n or len(FACTORS[a]) < n:
        return []
    return [
        {a: FACTORS[a][i], b: FACTORS[b][j], c: FACTORS[c][(i + j) % n]}
        for i, j in itertools.product(range(n), repeat=2)
    ]


def rows() -> list[Row]:
    """A pairwise covering set of runs: the first three factors' Latin square filled in
    greedily, then, while a pair is uncovered, the row that covers most of those left (each
    uncovered pair of the first factor pair left as the seed, under a few factor orders)."""
    uncovered = all_pairs()
    names = list(FACTORS)
    out: list[Row] = []
    for seed in _latin_square():
        if not _allowed(seed):  # a refused pair: its square's other pairs come greedily
            continue
        row = _complete(seed, names, uncovered)
        out.append(row)
        uncovered -= set(pairs_of(row))
    orders = [names[i:] + names[:i] for i in range(len(names))]
    while uncovered:
        first = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0])))
        seeds = [p for p in uncovered if (p[0][0], p[1][0]) == (first[0][0], first[1][0])]
        best, gain = None, -1
        for (a, va), (b, vb) in sorted(seeds):
            for order in orders:
                row = _complete({a: va, b: vb}, order, uncovered)
                new = sum(p in uncovered for p in pairs_of(row))
                if new > gain:
                    best, gain = row, new
        assert best is not None
        out.append({k: best[k] for k in names})
        uncovered -= set(pairs_of(best))
    return out


def refusal_rows() -> list[tuple[Row, str]]:
    """One run per refused pair (the pair, the rest plain), with the phrase it must print."""
    plain = {k: v[0] for k, v in FACTORS.items()}
    return [({**plain, a: va, b: vb}, why) for ((a, va), (b, vb)), why in REFUSED.items()]


# ---- a row as torchtitan arguments (the Llama3 debug TOML's job, overridden) ----

#: each family at a CPU's size (tests/test_titan_models.py says why these flavors)
# fmt: off
MODELS: dict[str, list[str]] = {
    "llama3": ["--training.seq_len", "256"],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.seq_len", "128"],
    "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_cpu",
                  "--training.seq_len", "128"],
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
                    "--training.seq_len", "128"],
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel_cpu",
                "--training.seq_len", "256"],
    "qwen3_5": ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_cpu",
                "--training.seq_len", "128"],
}
#: K = 4 segments of each length, uneven
EXPLICIT = {"128": "40,32,32,24", "256": "80,64,64,48"}
PARALLEL: dict[str, list[str]] = {
    "none": ["--parallelism.data_parallel_shard_degree", "1"],
    "fsdp": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp": ["--parallelism.tensor_parallel_degree", "2",
           "--parallelism.data_parallel_shard_degree", "1"],
    "cp": ["--parallelism.context_parallel_degree", "2",
           "--parallelism.data_parallel_shard_degree", "1"],
    "dp_replicate": ["--parallelism.data_parallel_replicate_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1"],
}
# fmt: on


def seq_len(row: Row) -> str:
    args = MODELS[row["model"]]
    return args[args.index("--training.seq_len") + 1]


def data_parallel(row: Row) -> int:
    """The data-parallel degree: the PP=1 reference runs with it (the global batch grows)."""
    return 2 if row["parallel"] in ("fsdp", "dp_replicate") else 1


def processes(row: Row) -> int:
    return 2 * (1 if row["parallel"] == "none" else 2)


def row_args(row: Row) -> list[str]:
    """The PP=2 run of ``row``."""
    args = ["--parallelism.pipeline_parallel_degree", "2", *MODELS[row["model"]],
            "--parallelism.pipeline_parallel_schedule", row["schedule"],
            *PARALLEL[row["parallel"]], "--seq1f1b.seq_chunks", "4",
            "--activation_checkpoint.mode", row["ac"],
            "--seq1f1b.loss_chunks", "4" if row["loss"] == "chunked" else "0"]  # fmt: skip
    split = EXPLICIT[seq_len(row)] if row["split"] == "explicit" else row["split"]
    args += ["--seq1f1b.seq_split", split]
    if row["compile"] == "compiled":
        args.append("--compile.enable")
    if row["precision"] == "bf16":
        args += ["--training.mixed_precision_param", "bfloat16"]
    return args


#: models whose PP=1 numbers move with TP beyond rounding, so their TP rows are compared with
#: PP=1 under the same TP (GPT-OSS: step 1's loss 8.1206 with TP = 2, 8.1470 without, PP=1
#: and PP=2 alike: torchtitan 0.3's experts add their output bias once per TP rank under the
#: spmd_types backend, their TP degree being read from DTensor parameters only). CP moves no
#: number (and PP=1 runs without it: the Seq1F1B trainer's CP needs PP)
SHARDING_MOVES_NUMBERS = frozenset({"gpt_oss"})


def reference_key(row: Row) -> tuple[str, str, int, str]:
    """What the PP=1 reference of ``row`` depends on: checkpointing, the split, the loss's
    chunks, the schedule, TP and CP change no number beyond fp32 rounding (but TP for
    :data:`SHARDING_MOVES_NUMBERS`); compiling, beyond bf16's where the run is bf16."""
    sharded = row["parallel"] == "tp" and row["model"] in SHARDING_MOVES_NUMBERS
    return row["model"], row["precision"], data_parallel(row), row["parallel"] if sharded else ""


def reference_processes(key: tuple[str, str, int, str]) -> int:
    return key[2] * (2 if key[3] else 1)


def reference_args(key: tuple[str, str, int, str]) -> list[str]:
    """The PP=1 run that ``key``'s rows are compared with."""
    model, precision, dp, sharded = key
    args = ["--parallelism.pipeline_parallel_degree", "1", *MODELS[model],
            "--parallelism.data_parallel_shard_degree", str(dp)]  # fmt: skip
    if sharded:
        args += PARALLEL[sharded][:2]
    if precision == "bf16":
        args += ["--training.mixed_precision_param", "bfloat16"]
    return args
