"""Token sources the global sampler indexes (numpy only; memory-mapped, nothing read
until a sample is asked for). Each is a sequence of samples of ``seq_len + 1`` token ids
(inputs are ``[:-1]``, labels ``[1:]``):

- ``TokenArray``: a ``.npy`` array, either ``[N, seq_len + 1]`` (one sample per row) or a
  1-D token stream packed into consecutive windows of ``seq_len + 1`` tokens overlapping
  by one (window i starts at token i·seq_len);
- ``MegatronIndexed``: Megatron-LM's indexed dataset (``prefix.bin`` + ``prefix.idx``,
  the ``MMIDIDX`` format, version 1): its sequences concatenated in order and packed the
  same way (document boundaries are not respected, as in packed pre-training).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A data file that cannot be used (the message names it and says why)."""


class _Packed:
    """Windows of ``seq_len + 1`` tokens over a 1-D stream, overlapping by one token."""

    def __init__(self, stream: np.ndarray, seq_len: int, where: str) -> None:
        if seq_len < 1:
            raise DataError(f"{where}: seq_len must be >= 1, got {seq_len}")
        self.stream, self.seq_len = stream, seq_len
        self.n = (len(stream) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"{where}: {len(stream)} tokens hold no sample of {seq_len} + 1 tokens")

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        start = i * self.seq_len
        return np.asarray(self.stream[start:start + self.seq_len + 1], dtype=np.int64)


class TokenArray:
    """A ``.npy`` token array (see the module's docstring)."""

    def __init__(self, path: str | Path, seq_len: int | None = None) -> None:
        self.path = str(path)
        try:
            data = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {self.path}: {exc}") from None
        if not np.issubdtype(data.dtype, np.integer):
            raise DataError(f"{self.path}: need integer token ids, got dtype {data.dtype}")
        if data.ndim == 2:
            if data.shape[0] < 1 or data.shape[1] < 2:
                raise DataError(f"{self.path}: need [N, seq_len + 1] with N >= 1, seq_len >= 1; got {data.shape}")
            if seq_len is not None and data.shape[1] != seq_len + 1:
                raise DataError(f"{self.path}: rows of {data.shape[1]} tokens, not seq_len + 1 = {seq_len + 1}")
            self.rows, self.packed = data, None
            self.seq_len = data.shape[1] - 1
        elif data.ndim == 1:
            if seq_len is None:
                raise DataError(f"{self.path}: a 1-D token stream needs seq_len (the samples' length)")
            self.rows, self.packed = None, _Packed(data, seq_len, self.path)
            self.seq_len = seq_len
        else:
            raise DataError(f"{self.path}: need a 1-D token stream or [N, seq_len + 1] rows, got shape {data.shape}")

    def __len__(self) -> int:
        return len(self.packed) if self.packed is not None else self.rows.shape[0]

    def sample(self, i: int) -> np.ndarray:
        if self.packed is not None:
            return self.packed.sample(i)
        if not 0 <= i < self.rows.shape[0]:
            raise IndexError(f"sample {i} of {self.rows.shape[0]}")
        return np.asarray(self.rows[i], dtype=np.int64)

    def batch(self, indices: Sequence[int]) -> np.ndarray:
        return batch(self, indices)


# Megatron-LM's indexed dataset: the .idx header and its dtype codes
_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}


class MegatronIndexed:
    """Megatron's ``prefix.bin`` + ``prefix.idx`` (see the module's docstring)."""

    def __init__(self, prefix: str | Path, seq_len: int) -> None:
        prefix = str(prefix).removesuffix(".idx").removesuffix(".bin")
        idx, binary = prefix + ".idx", prefix + ".bin"
        try:
            with open(idx, "rb") as f:
                head = f.read(9 + 8 + 1 + 8 + 8)
        except OSError as exc:
            raise DataError(f"cannot read {idx}: {exc.strerror}") from None
        if len(head) < 34 or head[:9] != _MAGIC:
            raise DataError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX header)")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != 1:
            raise DataError(f"{idx}: index version {version}; this reader knows version 1")
        code = head[17]
        if code not in _DTYPES or not np.issubdtype(_DTYPES[code], np.integer):
            raise DataError(f"{idx}: dtype code {code} is not an integer token type")
        dtype = np.dtype(_DTYPES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        try:
            index = np.memmap(idx, mode="r", dtype=np.uint8)
            stream = np.memmap(binary, mode="r", dtype=dtype)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {prefix}.bin/.idx: {exc}") from None
        need = 34 + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(index) < need:
            raise DataError(f"{idx}: {len(index)} bytes, the header promises {need}")
        sizes = np.frombuffer(index, dtype=np.int32, count=n_seq, offset=34)
        pointers = np.frombuffer(index, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
        # the sequences must lie back to back from the start of .bin (how every writer lays them out)
        expected = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))[:-1]]) * dtype.itemsize
        if n_seq and (not np.array_equal(pointers, expected) or int(sizes.sum()) > len(stream)):
            raise DataError(f"{prefix}: the sequences are not laid out back to back in {binary}")
        self.sizes, self.dtype = sizes, dtype
        self.packed = _Packed(stream[:int(sizes.sum())], seq_len, prefix)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.packed)

    def sample(self, i: int) -> np.ndarray:
        return self.packed.sample(i)

    def batch(self, indices: Sequence[int]) -> np.ndarray:
        return batch(self, indices)


def batch(source, indices: Sequence[int]) -> np.ndarray:
    """[len(indices), seq_len + 1] int64: the samples at ``indices``."""
    if not indices:
        return np.zeros((0, source.seq_len + 1), dtype=np.int64)
    return np.stack([source.sample(i) for i in indices])


def open_tokens(path: str | Path, seq_len: int | None = None, vocab: int | None = None):
    """The token source at ``path``: a ``.npy`` file, or a Megatron prefix (``x`` for
    ``x.bin`` + ``x.idx``, or either file's name). ``vocab``: check the ids of the first
    and last samples are within it (a cheap guard; a full scan reads the whole file)."""
    p = str(path)
    if p.endswith(".npy"):
        source = TokenArray(p, seq_len)
    elif p.endswith((".idx", ".bin")) or Path(p + ".idx").exists():
        if seq_len is None:
            raise DataError(f"{p}: a Megatron indexed dataset needs seq_len")
        source = MegatronIndexed(p, seq_len)
    else:
        raise DataError(f"{p}: not a .npy token array or a Megatron .bin/.idx prefix")
    if vocab is not None:
        for i in {0, len(source) - 1}:
            s = source.sample(i)
            if s.min() < 0 or s.max() >= vocab:
                raise DataError(f"{p}: sample {i} has token ids outside 0..{vocab - 1} (the model's vocab)")
    return source
