"""Workload-balanced packing (``torchtitan_integration.balanced_packing``): a step's rows are
rebuilt from the same (input, label) pairs, with positions restarting on every piece, and the
costliest row costs no more (and less on a skewed step); the dataset wrapper resumes exactly
from a checkpoint taken mid-group."""

from __future__ import annotations

import copy
import random
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from torchtitan_integration.balanced_packing import (
    BalancedPackingDataset,
    Piece,
    assign_pieces,
    balance_rows,
    pieces_from_eos,
    pieces_from_positions,
)

EOS = 0


def rows_from_pieces(lengths: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """Rows of the given piece lengths: piece j's token i is ``1000 * (j + 1) + i`` (its
    label that plus one), positions 0..n-1 per piece."""
    inputs, positions, j = [], [], 0
    for row in lengths:
        toks, pos = [], []
        for n in row:
            j += 1
            toks += [1000 * j + i for i in range(n)]
            pos += list(range(n))
        inputs.append(toks)
        positions.append(pos)
    x = torch.tensor(inputs)
    return x, x + 1, torch.tensor(positions)


def pairs(inputs: torch.Tensor, labels: torch.Tensor) -> Counter:
    return Counter(zip(inputs.flatten().tolist(), labels.flatten().tolist(), strict=True))


def max_cost(positions: torch.Tensor) -> int:
    rows = {}
    for p in pieces_from_positions(positions):
        rows[p.row] = rows.get(p.row, 0) + p.length**2
    return max(rows.values())


def check_rows(x, y, p, nx, ny, np_) -> None:
    """Same pairs, same shape; every new piece is a contiguous run of one source piece, with
    positions 0, 1, ... on it."""
    assert nx.shape == x.shape and ny.shape == y.shape and np_.shape == p.shape
    assert pairs(nx, ny) == pairs(x, y)
    for piece in pieces_from_positions(np_):
        run = np_[piece.row, piece.start : piece.start + piece.length]
        toks = nx[piece.row, piece.start : piece.start + piece.length]
        assert run.tolist() == list(range(piece.length))
        assert (toks.diff() == 1).all() and len(set((toks // 1000).tolist())) == 1


@pytest.mark.fast  # milliseconds
def test_skewed_step_is_balanced_exactly() -> None:
    # one row: a long document and a medium one; three rows of many short ones
    x, y, p = rows_from_pieces([[48, 16], *[[4] * 16] * 3])
    nx, ny, np_ = balance_rows(x, y, p)
    check_rows(x, y, p, nx, ny, np_)
    assert max_cost(p) == 48**2 + 16**2
    assert max_cost(np_) == 48**2 + 4 * 4**2  # the long document among short ones
    again = balance_rows(x, y, p)
    assert all(torch.equal(a, b) for a, b in zip(again, (nx, ny, np_), strict=True))


@pytest.mark.fast  # milliseconds
@pytest.mark.parametrize("seed", range(20))
def test_random_steps_keep_pairs_and_never_cost_more(seed: int) -> None:
    rng = random.Random(seed)
    rows, seq_len = rng.randint(1, 6), rng.choice([16, 32, 64])
    stream = []
    while sum(stream) < rows * seq_len:
        stream.append(rng.choice([1, 2, 3, 5, 8, 20, 40, 90]))
    lengths, row, left = [], [], seq_len  # cut the stream into rows, as torchtitan packs
    for n in stream:
        while n > 0 and len(lengths) < rows:
            take = min(n, left)
            row.append(take)
            n, left = n - take, left - take
            if left == 0:
                lengths.append(row)
                row, left = [], seq_len
    x, y, p = rows_from_pieces(lengths)
    nx, ny, np_ = balance_rows(x, y, p)
    check_rows(x, y, p, nx, ny, np_)
    assert max_cost(np_) <= max_cost(p)


@pytest.mark.fast  # milliseconds
def test_split_pieces_fill_rows_and_restart() -> None:
    pieces = [Piece(0, 0, 7), Piece(1, 0, 7), Piece(2, 0, 7), Piece(3, 0, 9)]  # 30 tokens
    layout = assign_pieces(pieces, 3, 10)
    assert layout is not None
    assert [sum(n for _, _, n in row) for row in layout] == [10, 10, 10]
    runs = Counter((i, off, n) for row in layout for i, off, n in row)
    for i, piece in enumerate(pieces):  # each piece covered once, by consecutive runs
        covered = sorted((off, n) for j, off, n in runs if j == i)
        assert sum(n for _, n in covered) == piece.length and covered[0][0] == 0
    assert any(off > 0 for row in layout for _, off, _ in row)  # some piece was split


@pytest.mark.fast  # milliseconds
def test_single_document_passes_through() -> None:
    x = torch.arange(3 * 16).reshape(3, 16) + 1
    p = torch.arange(16).repeat(3, 1)  # one document over three rows (renormalized)
    out = balance_rows(x, x + 1, p)
    assert out[0] is x and out[2] is p


def eos_rows(docs: list[int], rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """0.2.2's rows: documents of the given lengths (their last token EOS) packed end to
    end; a label is the stream's next token."""
    stream = []
    for j, n in enumerate(docs):
        stream += [1000 * (j + 1) + i for i in range(n - 1)] + [EOS]
    t = torch.tensor(stream[: rows * seq_len + 1])
    return t[:-1].reshape(rows, seq_len), t[1:].reshape(rows, seq_len)


@pytest.mark.fast  # milliseconds
def test_eos_rows_keep_documents_apart() -> None:
    x, y = eos_rows([20, 12] + [4] * 25, 4, 32)  # every row ends at an EOS
    nx, ny, np_ = balance_rows(x, y, eos_id=EOS)
    assert np_ is None and nx.shape == x.shape
    assert pairs(nx, ny) == pairs(x, y)
    assert eos_max_cost(x) == 20**2 + 12**2 and eos_max_cost(nx) == 20**2 + 3 * 4**2
    for piece in pieces_from_eos(nx, EOS):  # a document never runs into another
        toks = nx[piece.row, piece.start : piece.start + piece.length]
        body = toks[toks != EOS]
        assert (toks[:-1] != EOS).all()
        assert (body.diff() == 1).all() and len(set((body // 1000).tolist())) <= 1


@pytest.mark.fast  # milliseconds
def test_eos_rows_pass_through_when_open_documents_block_the_layout() -> None:
    # every row ends inside a document, which must stay at a row's end: when the greedy
    # would have to split a piece into a row that already ends in one, arrival order stays
    x, y = eos_rows([20, 14] + [3, 4, 5] * 12, 4, 32)
    out = balance_rows(x, y, eos_id=EOS)
    assert out[0] is x and out[1] is y


def eos_max_cost(inputs: torch.Tensor) -> int:
    rows = [0] * inputs.shape[0]
    for p in pieces_from_eos(inputs, EOS):
        rows[p.row] += p.length**2
    return max(rows)


class PackedText(IterableDataset):
    """torchtitan 0.3's HuggingFaceTextDataset in miniature: documents of deterministic
    lengths, shifted within the document, packed into rows with positions reset (and a
    continued document renormalized to start at 0); its state is the document index and the
    buffers."""

    def __init__(self, seq_len: int = 32) -> None:
        self.seq_len, self.doc = seq_len, 0
        self.inputs: list[int] = []
        self.labels: list[int] = []
        self.positions: list[int] = []

    def __iter__(self):
        while True:
            n = [50, 3, 4, 2, 5, 3, 20, 2, 3, 6, 4][self.doc % 11] + 1
            tokens = [1000 * (self.doc + 1) + i for i in range(n)]
            self.doc += 1
            self.inputs += tokens[:-1]
            self.labels += tokens[1:]
            self.positions += list(range(n - 1))
            while len(self.inputs) >= self.seq_len:
                pos, first = self.positions[: self.seq_len], self.positions[0]
                for i, q in enumerate(pos if first > 0 else []):  # _normalize_positions
                    if q == 0:
                        break
                    pos[i] = q - first
                row = (
                    {"input": torch.tensor(self.inputs[: self.seq_len]),
                     "positions": torch.tensor(pos)},
                    torch.tensor(self.labels[: self.seq_len]),
                )  # fmt: skip
                self.inputs = self.inputs[self.seq_len :]  # before yielding, as torchtitan
                self.labels = self.labels[self.seq_len :]
                self.positions = self.positions[self.seq_len :]
                yield row

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy({"doc": self.doc, "inputs": self.inputs, "labels": self.labels,
                              "positions": self.positions})  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.doc, self.inputs = state["doc"], list(state["inputs"])
        self.labels, self.positions = list(state["labels"]), list(state["positions"])


def flat(rows: list) -> list[list[list[int]]]:
    return [[x["input"].tolist(), x["positions"].tolist(), y.tolist()] for x, y in rows]


@pytest.mark.fast  # milliseconds
def test_dataset_balances_groups_and_resumes_mid_group() -> None:
    expected = list(islice(BalancedPackingDataset(PackedText(), 4), 12))
    plain = list(islice(PackedText(), 12))
    for g in range(3):  # each group of 4 rows: the plain group's pairs, costliest row cheaper
        ours, theirs = expected[4 * g : 4 * g + 4], plain[4 * g : 4 * g + 4]
        x = torch.stack([r[0]["input"] for r in theirs])
        nx = torch.stack([r[0]["input"] for r in ours])
        assert pairs(nx, torch.stack([r[1] for r in ours])) == pairs(
            x, torch.stack([r[1] for r in theirs])
        )
        assert max_cost(torch.stack([r[0]["positions"] for r in ours])) <= max_cost(
            torch.stack([r[0]["positions"] for r in theirs])
        )
    assert flat(expected) != flat(plain)  # something moved
    ds = BalancedPackingDataset(PackedText(), 4)
    first = list(islice(iter(ds), 6))  # mid-way through the second group
    state = copy.deepcopy(ds.state_dict())
    resumed = BalancedPackingDataset(PackedText(), 4)
    resumed.load_state_dict(state)
    rest = list(islice(iter(resumed), 6))
    assert flat(first + rest) == flat(expected)


class ByteTokenizer:
    """A stand-in tokenizer: a text's first 40 bytes (plus BOS 1 and EOS 2), shifted by 3."""

    eos_id = 2

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [1] * add_bos + [b + 3 for b in text.encode()[:40]] + [2] * add_eos


def test_titan03_switch_builds_the_balanced_dataloader() -> None:
    """Not in the fast tier: loading the corpus takes a few seconds."""
    from torchtitan_integration.versions import TITAN_0_3, titan_generation

    if titan_generation() != TITAN_0_3:
        pytest.skip("torchtitan 0.3's dataloader")
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from torchtitan_integration import assets
    from torchtitan_integration.config import Seq1F1B
    from torchtitan_integration.v03 import _titan
    from torchtitan_integration.v03.dataloader import BalancedTextDataLoader, balanced_dataloader
    from torchtitan_integration.v03.toml import build_config

    assert Seq1F1B().balanced_packing is False  # off by default
    toml = Path(__file__).resolve().parents[1] / "train_configs" / "llama3_debug_seq1f1b.toml"
    assert build_config(toml, ["--seq1f1b.balanced_packing"]).seq1f1b.balanced_packing
    with pytest.raises(ValueError, match="HuggingFaceTextDataLoader"):
        balanced_dataloader(ParallelAwareDataloader.Config(), 4)
    config = balanced_dataloader(HuggingFaceTextDataLoader.Config(dataset=assets.DATASET_NAME), 4)
    assert type(config) is BalancedTextDataLoader.Config and config.rows_per_step == 4
    assets.register_dataset(_titan.DATASET_CONFIG.get(), _titan.DATASETS.get())  # as the trainer
    loader = config.build(dp_world_size=1, dp_rank=0, tokenizer=ByteTokenizer(), seq_len=64,
                          local_batch_size=2, snapshot_every_n_steps=None)  # fmt: skip
    batches = list(islice(iter(loader), 4))  # two steps of two microbatches of two rows
    for step in (batches[:2], batches[2:]):
        x = torch.cat([b[0]["input"] for b in step])
        p = torch.cat([b[0]["positions"] for b in step])
        assert x.shape == (4, 64) and (p[:, 0] == 0).all()
        for piece in pieces_from_positions(p):
            run = p[piece.row, piece.start : piece.start + piece.length]
            assert run.tolist() == list(range(piece.length))
    # on many short documents (one per blank-line block), the same rows as torchtitan's own
    # dataloader, step by step, only regrouped: and at least one step is regrouped
    blocks = dict(dataset=assets.BLOCKS_DATASET_NAME)
    build = dict(dp_world_size=1, dp_rank=0, tokenizer=ByteTokenizer(), seq_len=256,
                 local_batch_size=2, snapshot_every_n_steps=None)  # fmt: skip
    plain = HuggingFaceTextDataLoader.Config(**blocks).build(**build)
    ours = balanced_dataloader(HuggingFaceTextDataLoader.Config(**blocks), 4).build(**build)
    changed = 0
    a, b = list(islice(iter(plain), 8)), list(islice(iter(ours), 8))
    for step in range(4):
        rows = [torch.cat([bt[0]["input"] for bt in s[2 * step : 2 * step + 2]]) for s in (a, b)]
        labs = [torch.cat([bt[1] for bt in s[2 * step : 2 * step + 2]]) for s in (a, b)]
        pos = [torch.cat([bt[0]["positions"] for bt in s[2 * step : 2 * step + 2]]) for s in (a, b)]
        assert pairs(rows[0], labs[0]) == pairs(rows[1], labs[1])
        assert max_cost(pos[1]) <= max_cost(pos[0])
        changed += int(not torch.equal(rows[0], rows[1]))
    assert changed > 0
