"""Offline tokenizer and dataset, built at first use from the Python standard library.

No hub downloads: the corpus is the running interpreter's own stdlib source (a code corpus in
the spirit of the codeparrot data the Seq1F1B authors train on), one JSON line per file, and a
byte-level BPE tokenizer trained on it with the ``tokenizers`` package. Both are deterministic
for a given Python version. ``python -m torchtitan_integration.assets [DIR]`` builds them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("assets")
DATASET_NAME = "pycode"
BLOCKS_DATASET_NAME = "pycode_blocks"  # the same corpus, one document per blank-line block
VOCAB_SIZE = 2048  # torchtitan's debugmodel vocabulary
MAX_BYTES = 4 * 1024 * 1024
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}
    files = [
        p
        for p in root.rglob("*.py")
        if not skip.intersection(p.relative_to(root).parts) and p.stat().st_size < 200_000
    ]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _write_corpus(out: Path) -> Path:
    path = out / "pycode" / "train.jsonl"
    path.parent.mkdir(parents=True)
    total = 0
    with path.open("w", encoding="utf-8") as f:
        for p in _stdlib_files():
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= MAX_BYTES:
                break
    return path


def _train_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer)
    (out / "tokenizer").mkdir()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[2],
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def ensure_assets(root: Path | str = DEFAULT_DIR) -> Path:
    """Build ``root/tokenizer`` and ``root/pycode/train.jsonl`` unless they exist (race-safe)."""
    root = Path(root)
    if (root / "tokenizer" / "tokenizer.json").exists() and (root / "pycode").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".assets-", dir=root.parent))
    try:
        _train_tokenizer(_write_corpus(tmp), tmp)
        try:
            os.rename(tmp, root)  # atomic; another process may have won the race
        except OSError:
            if not (root / "tokenizer" / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def register_dataset(
    dataset_config: Any, registry: dict[str, Any], root: Path | str = DEFAULT_DIR
) -> None:
    """Make ``[training] dataset = "pycode"`` (and ``"pycode_blocks"``) load the local corpus
    (offline): entries in torchtitan's dataset ``registry`` (its ``DATASETS``), made
    with its ``DatasetConfig`` (both from the version's seam)."""

    def load(path: str):
        from datasets import load_dataset

        p = Path(path)
        files = str(p / "train.jsonl") if p.is_dir() else str(p)
        return load_dataset("json", data_files=files, split="train")

    def load_blocks(path: str):
        def split(batch: dict) -> dict:
            blocks = [b for text in batch["text"] for b in text.split("\n\n") if b.strip()]
            return {"text": blocks}

        return load(path).map(split, batched=True, remove_columns=["text"])

    path = str(Path(root) / "pycode")
    registry[DATASET_NAME] = dataset_config(
        path=path, loader=load, sample_processor=lambda s: s["text"]
    )
    # many short documents (tens of tokens): packed-document masking has work to do
    registry[BLOCKS_DATASET_NAME] = dataset_config(
        path=path, loader=load_blocks, sample_processor=lambda s: s["text"]
    )


if __name__ == "__main__":
    print(ensure_assets(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
