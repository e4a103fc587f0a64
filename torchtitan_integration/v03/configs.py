"""Config functions for torchtitan 0.3 (``--module torchtitan_integration --config NAME``).

:func:`seq1f1b_debugmodel` is the default run of ``train_configs/llama3_debug_seq1f1b.toml``
in 0.3's terms: torchtitan's Llama3 debug model, PP=2 with Seq1F1B (K=4, compute split) on
the offline ``pycode`` corpus, sized for 2 CPU processes. :func:`seq1f1b_model` is the same
trainer for any supported family and flavor (:mod:`.models`), :func:`seq1f1b_llama3` and
:func:`seq1f1b_qwen3` name the family; the TOML launcher (:mod:`.toml`) starts from it.
"""

from __future__ import annotations

from typing import Any

from .models import family
from .trainer import Seq1F1BTrainer


def seq1f1b_model(name: str, flavor: str = "debugmodel", attn_backend: str = "flex") -> Any:
    """torchtitan's ``name`` model (a :mod:`.models` family) of ``flavor`` as a
    :class:`Seq1F1BTrainer.Config`.

    The attention backend only matters for torch's own schedules: Seq1F1B and unpipelined
    runs replace it with chunk-aware attention over the same packed documents.
    """
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size

    spec = family(name).model_spec(flavor, attn_backend)
    config = Seq1F1BTrainer.Config(
        model_spec=spec,
        # as torchtitan's llama3 configs: head + loss in chunks (under Seq1F1B per segment,
        # seq1f1b.ChunkedLoss), so no [batch, seq, vocab] state is kept for backward
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
        optimizer=default_adamw(lr=8e-4),
        dataloader=HuggingFaceTextDataLoader.Config(),
    )
    # 0.3's CUDA graphs support no pipeline parallelism; a 0.2.2 TOML never asks for them
    config.training.disable_cuda_graphs = True
    return config


def seq1f1b_llama3(flavor: str = "debugmodel", attn_backend: str = "flex") -> Any:
    """torchtitan's llama3 ``flavor`` with Seq1F1B (:func:`seq1f1b_model`)."""
    return seq1f1b_model("llama3", flavor, attn_backend)


def seq1f1b_qwen3(flavor: str = "debugmodel", attn_backend: str = "flex") -> Any:
    """torchtitan's qwen3 ``flavor`` (dense or MoE) with Seq1F1B (:func:`seq1f1b_model`)."""
    return seq1f1b_model("qwen3", flavor, attn_backend)


def seq1f1b_debugmodel() -> Any:
    """The default run: 30 steps of the debug model, PP=2, Seq1F1B K=4, 2 CPU processes."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config.configs import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from ..assets import DATASET_NAME, DEFAULT_DIR
    from ..config import Seq1F1B

    config = seq1f1b_llama3("debugmodel")
    config.hf_assets_path = f"./{DEFAULT_DIR}/tokenizer"
    config.optimizer = default_adamw(lr=2e-3)
    config.lr_scheduler = LRSchedulersContainer.Config(
        warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    )
    config.training = TrainingConfig(
        local_batch_size=4,
        seq_len=512,
        steps=30,
        max_norm=1.0,
        mixed_precision_param="float32",
        disable_cuda_graphs=True,  # CUDA graphs do not support pipeline parallelism
    )
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME)
    config.parallelism = ParallelismConfig(
        pipeline_parallel_degree=2,
        pipeline_parallel_schedule="Seq1F1B",
        pipeline_parallel_microbatch_size=2,
    )
    config.seq1f1b = Seq1F1B(seq_chunks=4, seq_split="compute")
    config.metrics = MetricsProcessor.Config(
        log_freq=1, enable_tensorboard=True, save_tb_folder="tb"
    )
    config.checkpoint = CheckpointManager.Config(enable=False, interval=10)
    config.activation_checkpoint = None
    config.debug = DebugConfig(seed=42)
    return config
