"""GPT samples over an indexed dataset, and the sampler that hands them to data-parallel ranks.

Documents are split into train/valid/test ranges as Megatron does (``949,50,1`` = fractions of the
document count, contiguous ranges, rounding fixed on the tail). Each split is an endless stream of
epochs. Epoch ``e`` shuffles the split's documents with a generator seeded from ``(seed, e)``, packs
them into one token stream and cuts it into samples of ``seq + 1`` tokens, neighbours sharing one
boundary token (sample ``k`` starts at token ``k * seq``; the tail shorter than a sample is dropped),
then visits the samples in a seeded random order.

Global sample id ``g`` is sample ``g % samples_per_epoch`` of epoch ``g // samples_per_epoch``. An
epoch depends only on (data, split, seq, seed, epoch), never on how many samples a run asks for, so
a longer run, a restart or a switch of dp/mbs/gbs never reorders samples already seen. Epochs are built
on first use and cached as ``.npy`` files named by a sha256 of what they depend on, with a
``_sha256.json`` beside them holding the SHA-256 of each array's values (written last): a cached array whose
values changed (zeroed, truncated to the right shape, swapped) would silently change what is trained, so an
epoch whose arrays do not match their checksums, or that has none, is rebuilt and its cache rewritten.

``model.family`` ``bert`` uses :class:`MaskedLMDataset`: the same cutting with ``seq - 2`` tokens per
sample, wrapped in ``[CLS] ... [SEP]`` and masked as a pure function of the sample id
(:mod:`cona.data.masking`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cona.atomic_files import atomic_open
from cona.config import ConaConfig
from cona.data.indexed import IndexedDataset
from cona.data.masking import SPECIALS_PER_SAMPLE, MaskingRule, mask_sample, masking_rule
from cona.data.split_ranges import split_document_ranges
from cona.data.tokenizer import BERT_WORDPIECE_LOWER, load_wordpiece_tokenizer
from cona.errors import DataError, LayoutError

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT = 1  # bump when the way epochs are built changes, so old cache files are not reused
EPOCHS_IN_MEMORY = 2
ARRAY_NAMES = ("doc_order", "sample_starts", "shuffle")
CHECKSUMS = "sha256"


@dataclass(frozen=True, kw_only=True)
class EpochIndex:
    doc_order: np.ndarray
    """Document ids of the split in this epoch's order."""
    sample_starts: np.ndarray
    """[samples, 2]: (position in doc_order, token offset in that document) where each sample starts."""
    shuffle: np.ndarray
    """The order in which the epoch's samples are visited."""


class GPTDataset:
    """Samples of ``seq + 1`` token ids of one split; see the module docstring for the order."""

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        name: str,
        documents: tuple[int, int],
        seq: int,
        seed: int,
        split: str,
        cache_dir: Path,
    ) -> None:
        self.indexed = indexed
        self.name = name
        self.documents = documents
        self.seq = seq
        self.seed = seed
        self.split = split
        self.cache_dir = cache_dir
        self.num_tokens = int(indexed.sizes[documents[0] : documents[1]].astype(np.int64).sum())
        # The last sample of an epoch ends at token samples * seq (inclusive), so it needs one extra token.
        self.samples_per_epoch = max(self.num_tokens - 1, 0) // seq
        self._epochs: dict[int, EpochIndex] = {}

    def __len__(self) -> int:
        """Samples in one epoch; ids beyond it come from later epochs (``__getitem__`` builds them)."""
        return self.samples_per_epoch

    def __getitem__(self, sample_id: int) -> np.ndarray:
        if sample_id < 0 or self.samples_per_epoch == 0:
            raise IndexError(
                f"sample id {sample_id} is out of range for the {self.name} split "
                f"({self.samples_per_epoch} samples per epoch)"
            )
        epoch, local = divmod(int(sample_id), self.samples_per_epoch)
        index = self.epoch_index(epoch)
        position, offset = (int(v) for v in index.sample_starts[index.shuffle[local]])
        tokens = np.empty(self.seq + 1, dtype=np.int64)
        filled = 0
        while filled < len(tokens):
            piece = self.indexed.get(int(index.doc_order[position]), offset, len(tokens) - filled)
            tokens[filled : filled + len(piece)] = piece
            filled += len(piece)
            position, offset = position + 1, 0
        return tokens

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [len(sample_ids), seq]: targets are the inputs shifted by one token."""
        tokens = torch.from_numpy(np.stack([self[int(i)] for i in sample_ids]))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def epoch_index(self, epoch: int) -> EpochIndex:
        if epoch not in self._epochs:
            if len(self._epochs) >= EPOCHS_IN_MEMORY:
                del self._epochs[next(iter(self._epochs))]
            self._epochs[epoch] = self._load_or_build(epoch)
        return self._epochs[epoch]

    def cache_description(self, epoch: int) -> dict:
        """Everything an epoch's index depends on; its sha256 names the cache files."""
        idx_stat, bin_stat = self.indexed.idx_path.stat(), self.indexed.bin_path.stat()
        return {
            "format": INDEX_FORMAT,
            "data": str(self.indexed.idx_path.resolve().with_suffix("")),
            "idx_bytes": idx_stat.st_size,
            "idx_mtime_ns": idx_stat.st_mtime_ns,
            "bin_bytes": bin_stat.st_size,
            "bin_mtime_ns": bin_stat.st_mtime_ns,
            "split": self.split,
            "split_name": self.name,
            "documents": list(self.documents),
            "seq": self.seq,
            "seed": self.seed,
            "epoch": epoch,
        }

    def cache_paths(self, epoch: int) -> dict[str, Path]:
        """The epoch's cached arrays by name, and :data:`CHECKSUMS` (their SHA-256, JSON)."""
        description = json.dumps(self.cache_description(epoch), sort_keys=True)
        key = hashlib.sha256(description.encode()).hexdigest()
        names = {name: f"{name}.npy" for name in ARRAY_NAMES} | {CHECKSUMS: f"{CHECKSUMS}.json"}
        return {name: self.cache_dir / f"{key}_{self.name}_{file}" for name, file in names.items()}

    def _load_or_build(self, epoch: int) -> EpochIndex:
        paths = self.cache_paths(epoch)
        cached = self._load(paths)
        if cached is not None:
            return cached
        index = self._build(epoch)
        for name in ARRAY_NAMES:
            _save_atomic(paths[name], getattr(index, name))
        checksums = json.dumps({name: _array_sha256(getattr(index, name)) for name in ARRAY_NAMES})
        _save_atomic(paths[CHECKSUMS], checksums)  # last: arrays without it are rebuilt
        return index

    def _load(self, paths: dict[str, Path]) -> EpochIndex | None:
        """The cached epoch, or None (rebuild and overwrite) when a file is missing or unreadable (e.g. cut
        short by a full disk), or an array's shape or values differ from what was saved."""
        if not all(path.is_file() for path in paths.values()):
            return None
        try:
            arrays = {name: np.load(paths[name], mmap_mode="r") for name in ARRAY_NAMES}
            checksums = json.loads(paths[CHECKSUMS].read_text())
        except (OSError, ValueError):
            return None
        num_documents = self.documents[1] - self.documents[0]
        shapes_ok = (
            arrays["doc_order"].shape == (num_documents,)
            and arrays["sample_starts"].shape == (self.samples_per_epoch, 2)
            and arrays["shuffle"].shape == (self.samples_per_epoch,)
        )
        if not shapes_ok or not isinstance(checksums, dict):
            return None
        if any(checksums.get(name) != _array_sha256(array) for name, array in arrays.items()):
            return None
        return EpochIndex(**arrays)

    def _build(self, epoch: int) -> EpochIndex:
        doc_rng, sample_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence([self.seed, epoch]).spawn(2)
        )
        begin, end = self.documents
        doc_order = begin + doc_rng.permutation(end - begin).astype(np.int64)
        sizes = self.indexed.sizes[doc_order].astype(np.int64)
        doc_ends = np.cumsum(sizes)
        sample_first_token = np.arange(self.samples_per_epoch, dtype=np.int64) * self.seq
        # The document holding a sample's first token is the first one ending after it (side="right"
        # also steps over empty documents).
        positions = np.searchsorted(doc_ends, sample_first_token, side="right")
        offsets = sample_first_token - (doc_ends[positions] - sizes[positions])
        shuffle = sample_rng.permutation(self.samples_per_epoch).astype(np.int64)
        return EpochIndex(
            doc_order=doc_order, sample_starts=np.stack([positions, offsets], axis=1), shuffle=shuffle
        )


class MaskedLMDataset(GPTDataset):
    """BERT samples of ``seq`` tokens: ``[CLS]``, ``seq - 2`` tokens of the packed stream, ``[SEP]``.

    The stream is cut as for GPT with ``seq - 2`` as the sample length (epochs, order and cache unchanged);
    GPT's one extra boundary token is dropped, so neighbouring samples do not overlap.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        name: str,
        documents: tuple[int, int],
        seq: int,
        seed: int,
        split: str,
        cache_dir: Path,
        rule: MaskingRule,
    ) -> None:
        content = seq - SPECIALS_PER_SAMPLE
        super().__init__(
            indexed, name=name, documents=documents, seq=content, seed=seed, split=split, cache_dir=cache_dir
        )
        self.rule = rule
        self.split_index = SPLIT_NAMES.index(name)

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [len(sample_ids), model.seq]: masked inputs; targets -100 where nothing
        is predicted."""
        pairs = [
            mask_sample(self[int(i)][:-1], self.rule, split_index=self.split_index, sample_id=int(i))
            for i in sample_ids
        ]
        inputs, targets = (torch.from_numpy(np.stack(parts)) for parts in zip(*pairs, strict=True))
        return inputs, targets


def _array_sha256(array: np.ndarray) -> str:
    """SHA-256 of the array's dtype, shape and values (in C order)."""
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def _save_atomic(path: Path, content: np.ndarray | str) -> None:
    """Several ranks may build the same epoch at once: each writes a private file and renames it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as out:  # a private temporary per writer
            if isinstance(content, str):
                out.write(content.encode())
            else:
                np.save(out, content)
    except OSError as err:
        raise DataError(
            f"training.data_cache_path: cannot write the sample index {path}: {err.strerror}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class Splits:
    train: GPTDataset
    valid: GPTDataset | None
    """None when the split has no documents or too few tokens for one sample."""
    test: GPTDataset | None


def default_cache_dir(data_prefix: str) -> Path:
    return Path(data_prefix).parent / "index-cache"


def build_datasets(config: ConaConfig) -> Splits:
    """The train/valid/test datasets of ``training.data_prefix`` for ``model.seq`` and ``training.seed``."""
    training = config.training
    where = f"{config.path}: " if config.path else ""
    if training.data.data_prefix is None:
        raise DataError(f"{where}training.data_prefix is not set")
    indexed = IndexedDataset(training.data.data_prefix)
    cache_dir = (
        Path(training.data.data_cache_path)
        if training.data.data_cache_path
        else default_cache_dir(training.data.data_prefix)
    )
    ranges = split_document_ranges(len(indexed), training.data.split)
    common = {
        "seq": config.model.seq,
        "seed": training.runtime.seed,
        "split": training.data.split,
        "cache_dir": cache_dir,
    }
    if config.model.family == "bert":
        rule = _masking_rule(config, where)
        datasets: dict[str, GPTDataset] = {
            name: MaskedLMDataset(indexed, name=name, documents=documents, rule=rule, **common)
            for name, documents in zip(SPLIT_NAMES, ranges, strict=True)
        }
    else:
        datasets = {
            name: GPTDataset(indexed, name=name, documents=documents, **common)
            for name, documents in zip(SPLIT_NAMES, ranges, strict=True)
        }
    train = datasets["train"]
    if train.documents[0] == train.documents[1]:
        raise DataError(
            f"{where}training.split {training.data.split!r} leaves the train split no documents "
            f"({len(indexed)} documents in {training.data.data_prefix})"
        )
    if train.samples_per_epoch == 0:
        raise DataError(
            f"{training.data.data_prefix}: the train split has {train.num_tokens} tokens, too few for one "
            f"sample of {_sample_tokens(config)} tokens"
        )
    usable = {name: ds if ds.samples_per_epoch > 0 else None for name, ds in datasets.items()}
    for dataset in usable.values():
        if dataset is not None:
            # Build (or load) epoch 0 now: errors surface at start-up, and a caller that lets rank 0
            # build first leaves the other ranks only reading the cache.
            dataset.epoch_index(0)
    return Splits(train=train, valid=usable["valid"], test=usable["test"])


def train_samples_per_epoch(config: ConaConfig) -> int:
    """Samples in one epoch of the train split, counted from the index alone (nothing is built or cached);
    0 when the split is empty or shorter than one sample (building the datasets refuses that)."""
    training = config.training
    if training.data.data_prefix is None:
        raise DataError("training.data_prefix is not set")
    indexed = IndexedDataset(training.data.data_prefix)
    begin, end = split_document_ranges(len(indexed), training.data.split)[0]
    tokens = int(indexed.sizes[begin:end].astype(np.int64).sum())
    seq = config.model.seq - (SPECIALS_PER_SAMPLE if config.model.family == "bert" else 0)
    return max(tokens - 1, 0) // seq


def _sample_tokens(config: ConaConfig) -> str:
    """What one sample reads from the packed stream, for error messages."""
    if config.model.family == "bert":
        return f"model.seq - 1 = {config.model.seq - 1}"  # seq - 2 between [CLS] and [SEP], plus GPT's one
    return f"model.seq + 1 = {config.model.seq + 1}"


def _masking_rule(config: ConaConfig, where: str) -> MaskingRule:
    """BERT's masking over the special ids of ``training.vocab_file`` (a WordPiece vocab.txt)."""
    training, model = config.training, config.model
    if training.data.tokenizer_type != BERT_WORDPIECE_LOWER or training.data.vocab_file is None:
        raise DataError(
            f"{where}model.family 'bert' needs training.tokenizer_type {BERT_WORDPIECE_LOWER!r} and "
            "training.vocab_file (the WordPiece vocab.txt the data was preprocessed with)"
        )
    if model.seq <= SPECIALS_PER_SAMPLE:
        raise DataError(f"{where}model.seq {model.seq} leaves no room for tokens between [CLS] and [SEP]")
    tokenizer = load_wordpiece_tokenizer(training.data.vocab_file)
    if model.vocab_size is not None and tokenizer.vocab_size > model.vocab_size:
        raise DataError(
            f"{where}model.vocab_size {model.vocab_size} is smaller than the {tokenizer.vocab_size} entries "
            f"of training.vocab_file {training.data.vocab_file}"
        )
    return masking_rule(tokenizer, seed=training.runtime.seed)


def micro_batch_sample_ids(
    consumed_samples: int, gbs: int, mbs: int, dp: int, dp_rank: int
) -> list[np.ndarray]:
    """This dp rank's micro-batches (global sample ids) for the step that starts at ``consumed_samples``.

    The step takes the ``gbs`` ids after ``consumed_samples``; micro step ``j`` takes the next ``mbs * dp``
    of them and rank ``r`` gets ``[r * mbs, (r + 1) * mbs)`` of those. Every step therefore consumes the
    same ids whatever dp and mbs are, and a gbs change just moves the next step's window.
    """
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be non-negative, got {consumed_samples}")
    if min(gbs, mbs, dp) <= 0 or gbs % (mbs * dp):
        raise LayoutError(f"gbs {gbs} is not a positive multiple of mbs * dp = {mbs} * {dp}")
    if not 0 <= dp_rank < dp:
        raise LayoutError(f"dp rank {dp_rank} is out of range for dp {dp}")
    per_micro_step = mbs * dp
    first = consumed_samples + dp_rank * mbs
    return [
        np.arange(first + j * per_micro_step, first + j * per_micro_step + mbs, dtype=np.int64)
        for j in range(gbs // per_micro_step)
    ]


def collate(dataset: GPTDataset, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 [len(sample_ids), model.seq]: next-token pairs for GPT, masked-LM pairs
    (targets -100 where nothing is predicted) for a :class:`MaskedLMDataset`."""
    return dataset.batch(sample_ids)
