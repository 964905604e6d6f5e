"""Training data: a resumable, deterministic stream of global batches over an image pool.

The pool (folders, file lists, webdataset shards such as the curation output) is opened through a compact
memory-mapped index (:mod:`.pool_index`: 20 bytes per image, shared by every worker) or, for small tools,
listed into references (:func:`list_pool`). Each epoch has a permutation fixed by (seed, epoch) — a keyed bijection
of [0, N) (:class:`EpochPermutation`, a Feistel network with cycle-walking) that each rank evaluates only at
the positions of its own slice, so no rank ever holds N indices (6.8 GB at 1.7B images as int32); global batch
``s`` is the next ``global_batch`` positions of it and rank ``r`` takes its slice, so the sequence of samples does not depend
on the number of processes or DataLoader workers. Augmentations are seeded per (seed, epoch, index), so
a sample looks the same whichever worker decodes it. The position — (epoch, offset) — is all a resume
needs: a rerun continues with exactly the batches it would have seen, even at another world size.
Corrupt images are skipped and counted by reason, never fatal.
"""

from __future__ import annotations

import collections
from functools import partial
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from ..utils import storage
from .decode import safe_decode
from .pool_index import Pool
from .sources import ImageRef, as_multi, stable_hash


@dataclass
class DataPosition:
    """Where the next global batch starts. Batches never straddle epochs (the remainder is dropped)."""

    epoch: int = 0
    offset: int = 0

    def next_batch(self, global_batch: int, pool_size: int) -> tuple[int, int]:
        """(epoch, offset) of the next batch, moving to the next epoch when this one has too few left."""
        if global_batch > pool_size:
            raise ValueError(f"global batch {global_batch} is larger than the pool ({pool_size} images)")
        if self.offset + global_batch > pool_size:
            self.epoch, self.offset = self.epoch + 1, 0
        return self.epoch, self.offset

    def advance(self, global_batch: int, pool_size: int) -> None:
        self.next_batch(global_batch, pool_size)
        self.offset += global_batch


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays: a fast, well-mixed 64-bit hash (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class EpochPermutation:
    """A keyed pseudo-random permutation of [0, n) evaluated at any positions, in O(1) memory per position.

    A balanced Feistel network over 2h-bit integers (2^2h >= n, at least 2 bits a half) with ``rounds`` rounds
    is a bijection of [0, 2^2h); positions that land at or above ``n`` are mapped again (cycle-walking) until they
    land inside, which keeps it a bijection of [0, n) (at most 4 n values are walked, usually 1-2 passes).
    The round keys come from (seed, epoch), so every rank, worker and rerun computes the same order.
    """

    def __init__(self, n: int, seed: int, epoch: int, rounds: int = 6) -> None:
        if n < 1:
            raise ValueError(f"cannot permute {n} items")
        self.n = int(n)
        self.half = max(2, (max(self.n - 1, 1).bit_length() + 1) // 2)  # bits per half: 2^(2 half) >= n
        self.mask = np.uint64((1 << self.half) - 1)
        base = stable_hash(f"{seed}/{epoch}")
        self.keys = [np.uint64(stable_hash(f"feistel/{base}/{r}") % 2**64) for r in range(rounds)]

    def __len__(self) -> int:
        return self.n

    def _once(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        with np.errstate(over="ignore"):
            for k in self.keys:
                left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << h) | right

    def at(self, positions) -> np.ndarray:
        """The permuted indices (int64) at ``positions`` (array-like of ints in [0, n))."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} of a permutation of {self.n}")
        todo = np.arange(x.size)
        while todo.size:
            x[todo] = self._once(x[todo])
            todo = todo[x[todo] >= np.uint64(self.n)]
        return x.astype(np.int64)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.at(np.arange(*key.indices(self.n), dtype=np.int64))
        return int(self.at([key])[0])


def epoch_permutation(n: int, seed: int, epoch: int) -> EpochPermutation:
    """The order of epoch ``epoch``: ``perm[lo:hi]`` evaluates only those positions (nothing of size n is built)."""
    return EpochPermutation(n, seed, epoch)


class GlobalBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields this rank's share of each global batch as [(index, epoch), ...], forever."""

    def __init__(self, pool_size: int, batch_per_rank: int, rank: int, world_size: int, seed: int,
                 start: DataPosition) -> None:
        self.n, self.b, self.rank, self.world, self.seed = pool_size, batch_per_rank, rank, world_size, seed
        self.pos = DataPosition(start.epoch, start.offset)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        G = self.b * self.world
        perm_epoch, perm = -1, None
        while True:
            epoch, off = self.pos.next_batch(G, self.n)
            if epoch != perm_epoch:
                perm_epoch, perm = epoch, epoch_permutation(self.n, self.seed, epoch)
            lo = off + self.rank * self.b
            yield [(int(i), epoch) for i in perm[lo : lo + self.b]]
            self.pos.advance(G, self.n)

    def __len__(self) -> int:  # infinite stream; DataLoader only needs this for len(), which we never call
        return 2**62


class ImagePoolDataset(Dataset):
    """Map-style: (index, epoch) -> transform(image, seed=...), or ("__corrupt__", reason) for unreadable files.

    ``refs`` is a :class:`~.pool_index.Pool` (memory-mapped; ``read`` = ``pool.read``) or a list of ImageRefs
    with their source's ``read``. ``transform`` takes a ``seed`` keyword (as MultiCropAugmentation does) so
    augmentation is reproducible.
    """

    def __init__(self, refs: Pool | Sequence[ImageRef], read: Callable[[Any], Optional[bytes]],
                 transform: Callable[[Any], Any], seed: int = 0, decode: Optional[Callable] = None) -> None:
        self.decode = decode or safe_decode  # bytes -> (image, None) | (None, reason); N channels: decode_channels
        # A Pool is kept as it is: copying it into a list would bring back one Python object per image.
        refs = refs if isinstance(refs, Pool) else list(refs)
        self.refs, self.read, self.transform, self.seed = refs, read, transform, seed

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, key: tuple[int, int]):
        where = None
        try:
            sample = self._get(key)
        except storage.Unreadable as e:  # an object the store definitely cannot give: counted by reason
            sample, where = ("__corrupt__", e.reason), e.url
        io = storage.take_counts()  # this worker's retries since its last sample ride along to the step summary
        if io and isinstance(sample, dict):
            sample = {**sample, "io": io}
        elif isinstance(sample, tuple) and sample[:1] == ("__corrupt__",):
            # (marker, reason, io, the file or object it came from: named if training stops on bad data)
            sample = (*sample[:2], io, where or self._where(key[0]))
        return sample

    def _where(self, index: int) -> str:
        ref = self.refs[index]
        loc = getattr(ref, "path", None) or getattr(ref, "loc", None)
        return str(loc[0] if isinstance(loc, (tuple, list)) else loc)

    def _get(self, key: tuple[int, int]):
        index, epoch = key
        # Per-sample seed: the same augmentation whichever worker (or how many) decodes it.
        seed = stable_hash(f"{self.seed}/{epoch}/{index}") % (2**63)
        if getattr(self.transform, "takes_bytes", False):  # the GPU path: bytes and drawn parameters only
            sample, reason = self.transform.from_bytes(self.read(self.refs[index]), seed)
            if sample is None:
                return ("__corrupt__", reason)
            sample["key"] = (epoch, index)
            return sample
        draft = getattr(self.transform, "draft_request", None)
        if draft is not None and self.decode is safe_decode:  # the crops, drawn first, pick a reduced decode
            img, reason = safe_decode(self.read(self.refs[index]), draft=partial(draft, seed=seed))
        else:
            img, reason = self.decode(self.read(self.refs[index]))
        if img is None:
            return ("__corrupt__", reason)
        sample = self.transform(img, seed=seed)
        if isinstance(sample, dict):
            sample["key"] = (epoch, index)
        return sample


class SkipCorrupt:
    """Collate wrapper: drops unreadable samples and reports them as batch['corrupt'] = {reason: n}."""

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list):
        corrupt = collections.Counter(x[1] for x in items if isinstance(x, tuple) and x and x[0] == "__corrupt__")
        good = [x for x in items if not (isinstance(x, tuple) and x and x[0] == "__corrupt__")]
        io: collections.Counter = collections.Counter()  # storage retries / unreadable objects, by kind
        for x in items:
            is_corrupt = isinstance(x, tuple) and x[:1] == ("__corrupt__",)
            extra = x.pop("io", None) if isinstance(x, dict) else x[2] if is_corrupt and len(x) > 2 else None
            io.update(extra or {})
        if good and isinstance(good[0], dict) and "key" in good[0]:
            # Batch-level randomness (iBOT masks) from the batch's identity: exact on resume, any worker.
            rng = np.random.default_rng(stable_hash(repr([g["key"] for g in good])) % (2**63))
            batch = self.collate(good, rng=rng)
        else:
            batch = self.collate(good) if good else {}
        batch["corrupt"] = dict(corrupt)
        batch["n_images"] = len(good)
        where = sorted({x[3] for x in items if isinstance(x, tuple) and x[:1] == ("__corrupt__",) and len(x) > 3})
        if where:
            batch["corrupt_where"] = where
        if io:
            batch["io"] = dict(io)
        return batch


def list_pool(paths: Sequence[str]) -> tuple[list[ImageRef], Callable[[ImageRef], Optional[bytes]]]:
    """References of every image in the given folders / file lists / shard paths, sorted by id.

    One Python object per image (~370 B each) and a tar header walk per call: fine for tools and small pools;
    training opens the pool through :func:`.pool_index.open_pool` instead (same order, 20 B per image)."""
    source = as_multi(list(paths))
    refs = sorted(source.refs(), key=lambda r: r.id)
    if not refs:
        raise ValueError(f"no images found in {list(paths)}")
    return refs, source.read


def build_train_loader(refs: Pool | Sequence[ImageRef], read: Callable, transform: Callable, collate: Callable,
                       batch_per_rank: int, rank: int, world_size: int, seed: int, start: DataPosition,
                       num_workers: int = 2, pin_memory: bool = False, worker_init_fn: Optional[Callable] = None,
                       persistent_workers: bool = False, decode: Optional[Callable] = None) -> DataLoader:
    dataset = ImagePoolDataset(refs, read, transform, seed, decode)
    sampler = GlobalBatchSampler(len(dataset), batch_per_rank, rank, world_size, seed, start)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=SkipCorrupt(collate),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        worker_init_fn=worker_init_fn,
        prefetch_factor=2 if num_workers > 0 else None,
    )


__all__ = ["DataPosition", "GlobalBatchSampler", "ImagePoolDataset", "SkipCorrupt", "list_pool",
           "build_train_loader", "epoch_permutation"]
