"""The ``[seq1f1b]`` TOML section, merged into torchtitan's JobConfig.

torchtitan merges this module's ``JobConfig`` into its own when a TOML sets
``[job] custom_config_module = "torchtitan_integration.config"`` (our train entry adds it if
missing), so ``--seq1f1b.seq_chunks 8`` works on the command line as well.
"""

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: keys of the ``[seq1f1b]`` section that were renamed -> their name now (same values)
RENAMED = {"split": "seq_split"}
_CONFIG_FILE = ("--job.config_file", "--job.config-file")


def config_file_arg(argv: Sequence[str]) -> str | None:
    """The TOML a torchtitan command line names (``--job.config_file X`` or ``=X``), if any."""
    path = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in _CONFIG_FILE:
            path = value if eq else (argv[i + 1] if i + 1 < len(argv) else path)
    return path


def load_toml(path: str) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict (``tomllib``, or ``tomli`` on Python 3.10)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


@dataclass
class Seq1F1B:
    seq_chunks: int = 4
    """K: segments each sample's sequence is cut into (1 = plain 1F1B over samples)."""

    seq_split: str = "compute"
    """'uniform', 'compute' (equal FLOPs under each sample's document mask), or lengths like
    '96,80,80' (the API's ``seq_split``; the old key ``split`` is refused, naming this one)."""

    loss_chunks: int = 0
    """Under the Seq1F1B schedules, run the last stage's output head and the loss in this many
    chunks of the sequence, each chunk's backward at once (``seq1f1b.ChunkedLoss``), so the
    last stage keeps hidden states for backward, not vocabulary-wide logits. torchtitan 0.3:
    ``ChunkedLossWrapper``'s ``num_chunks`` (0 = its own setting); 0.2.2: 0 = the plain loss."""

    verify: bool = False
    """At start-up, every rank checks torchtitan's Llama3 code as adapted here against the
    unpipelined model (seq1f1b.verify_model on the debug size, this run's stages and K);
    start-up fails, naming the cause, if it would not train exactly. A few seconds."""

    first_step_check: bool = True
    """The first step (and the first after the sequence length changes) checks the model as
    it trains: each stage's outputs for one sample, in its first two segments, against the
    stage run over them at once, plus the plain-SDPA and position-mixing guards; a mismatch
    stops every rank before the optimizer step, naming the stage, the segment and the likely
    cause (positions from the segment, attention not chunk-aware, a state not carried)."""

    kv_cache: str = "expanded"
    """What the K/V cache keeps of earlier segments: 'expanded' (every head's K and V) or
    'latent' (multi-head latent attention, deepseek_v3: the compressed latent and the RoPE key,
    576 values a token at 671B instead of 40,960, re-expanded for each later segment; exact,
    at the cost of the re-expansion's matmuls; not with context or tensor parallelism)."""

    balanced_packing: bool = False
    """Rebalance each step's packed rows by attention cost (WLB-LLM): the documents (and
    parts of documents) of the rows one data-parallel rank feeds per step
    (``local_batch_size``) are reassigned among those rows so that the costliest row, by the
    sum of its documents' squared lengths, costs as little as they allow; every (input,
    label) pair is kept, positions restart per piece. torchtitan 0.3's text dataloader only
    (``torchtitan_integration.balanced_packing``)."""

    stages_per_rank: int = 2
    """Stages per rank for InterleavedSeq1F1B (ignored when
    parallelism.pipeline_parallel_layers_per_stage is set)."""

    backward_send_waits: str = "consumed"
    """Where each unit's input gradient sent upstream is waited for, and freed: "consumed"
    (right after the first action that proves the peer received it; no stall) or "end"
    (torch 2.15's placement: held to the step's end, one unit's input gradient per unit on
    every stage but the first). torch 2.13/2.14 wait for sends their own way."""

    dry_run: bool = False
    """Train nothing: one step of each distinct pipeline rank at the configuration's real size
    and world size, in one CPU process under fake tensors and the fake process group (NGPU
    sets the world when the degrees leave it open); prints each rank's peak memory by kind
    against dry_run_gpu and its estimated device time (torchtitan 0.3 and torch 2.15;
    docs/dry_run.md)."""

    dry_run_gpu: str = "h100-80gb"
    """The GPU the dry run measures against, as the planner names them (a100-80gb,
    h100-80gb, h200)."""

    dry_run_picture: str = ""
    """A PNG of each dry-run rank's memory along its order ('' = none)."""

    dry_run_ranks: str = ""
    """The pipeline ranks the dry run runs, comma-separated (e.g. "0,7": the first, which
    holds the most activations and the embedding, and the last, the head and the loss);
    '' = every pipeline rank. Each takes minutes at real size."""

    dry_run_holders: int = 0
    """Under each dry-run rank's row, the largest groups of tensors alive at its peak (this
    many; 0 = none), each named by its kind, shape and dtype and the op and module that made
    it: where the activations and temporaries go."""


@dataclass
class JobConfig:
    seq1f1b: Seq1F1B = field(default_factory=Seq1F1B)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal under it), read from the source:
    the text ``--help`` shows, kept in one place with the field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def seq1f1b_help() -> str:
    """The ``[seq1f1b]`` keys, their defaults and what they do (``--help``, both torchtitans)."""
    docs = field_docs(Seq1F1B)
    lines = [
        "[seq1f1b] keys (in the TOML's [seq1f1b] section, or --seq1f1b.<key> <value>):",
    ]
    for f in dataclasses.fields(Seq1F1B):
        kind = getattr(f.type, "__name__", str(f.type))
        lines.append(f"  --seq1f1b.{f.name} {kind} (default: {f.default!r})")
        lines += textwrap.wrap(docs.get(f.name, ""), 92, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)  # fmt: skip
    return "\n".join(lines)


USAGE = """usage: python -m torchtitan_integration.train --job.config_file X.toml [--sec.key v ...]
       CONFIG_FILE=X.toml NGPU=<processes> ./run_train.sh [--sec.key v ...]
       (torchtitan 0.3 also: --module torchtitan_integration --config <function> [...])

Trains with a Seq1F1B schedule when the TOML sets [parallelism]
pipeline_parallel_schedule = "Seq1F1B" (or ZBSeq1F1B, ZBVSeq1F1B, InterleavedSeq1F1B), with
its [seq1f1b] section below; every other key is torchtitan's own, listed after it."""
