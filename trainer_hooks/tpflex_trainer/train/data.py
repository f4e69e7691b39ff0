"""The data contract of ``tpflex-train``: an integer array [N, seq_len + 1]; step s uses
rows (s·B + i) mod N for i < B (B the global batch), replica r takes its contiguous
slice (replicas in order); inputs are row[:-1], labels row[1:]."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class DataError(ValueError):
    """A token file that does not meet the contract (the message says why)."""


def load_tokens(path: str, vocab: int) -> np.ndarray:
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if data.ndim != 2 or data.shape[0] < 1 or data.shape[1] < 2:
        raise DataError(f"{path}: need an array [N, seq_len + 1] with N >= 1, seq_len >= 1; got shape {data.shape}")
    if not np.issubdtype(data.dtype, np.integer):
        raise DataError(f"{path}: need integer token ids, got dtype {data.dtype}")
    lo, hi = int(data.min()), int(data.max())
    if lo < 0 or hi >= vocab:
        raise DataError(f"{path}: token ids must be within 0..{vocab - 1} (the model's vocab), found {lo}..{hi}")
    return data


def global_rows(data: np.ndarray, step: int, global_batch: int) -> torch.Tensor:
    n = data.shape[0]
    idx = [(step * global_batch + i) % n for i in range(global_batch)]
    return torch.from_numpy(np.asarray(data[idx], dtype=np.int64))


def replica_batch(data: np.ndarray, step: int, local_batches: Sequence[int], replica_index: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one replica: its slice of the step's global batch."""
    rows = global_rows(data, step, sum(local_batches))
    start = sum(local_batches[:replica_index])
    mine = rows[start:start + local_batches[replica_index]]
    return mine[:, :-1], mine[:, 1:]
