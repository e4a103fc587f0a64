"""The ``[seq1f1b]`` TOML section, merged into torchtitan's JobConfig.

torchtitan merges this module's ``JobConfig`` into its own when a TOML sets
``[job] custom_config_module = "torchtitan_integration.config"`` (our train entry adds it if
missing), so ``--seq1f1b.seq_chunks 8`` works on the command line as well.
"""

from dataclasses import dataclass, field


@dataclass
class Seq1F1B:
    seq_chunks: int = 4
    """K: segments each sample's sequence is cut into (1 = plain 1F1B over samples)."""

    split: str = "compute"
    """'uniform', 'compute' (equal FLOPs under causal attention), or lengths like '96,80,80'."""

    stages_per_rank: int = 2
    """Stages per rank for InterleavedSeq1F1B (ignored when
    parallelism.pipeline_parallel_layers_per_stage is set)."""


@dataclass
class JobConfig:
    seq1f1b: Seq1F1B = field(default_factory=Seq1F1B)
