"""The global sampler (pure; numpy only): which samples step s trains on, whatever the
layout.

Step s takes the ``global_batch`` samples at positions s·B .. s·B + B - 1 of an endless
sequence of epochs; epoch e is a permutation of the dataset's sample indices drawn from
(seed, e) alone (or the identity without shuffling). So the samples of a step depend
only on (dataset size, global batch, seed, step): not on the TP degrees, the number of
replicas, their local batches or how often the job restarted. Replicas take contiguous
slices of the step's samples in replica order, of their (nonuniform) local batches,
which sum to the global batch. Resuming at step s is asking for step s: the state is the
next step, and the sampler checks on load that the dataset and batch did not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class SamplerError(ValueError):
    """A sampler setting or state that cannot be used (the message says which)."""


@dataclass
class GlobalSampler:
    n_samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    step: int = 0  # the next step to train (the resumable state)
    _perm: tuple[int, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise SamplerError(f"the dataset has no samples (n_samples={self.n_samples})")
        if self.global_batch < 1:
            raise SamplerError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.step < 0:
            raise SamplerError(f"step must be >= 0, got {self.step}")

    def _epoch(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                order = rng.permutation(self.n_samples)
            else:
                order = np.arange(self.n_samples)
            self._perm = (epoch, order)
        return self._perm[1]

    def samples(self, step: int) -> list[int]:
        """The sample indices of ``step``'s global batch, in order."""
        if step < 0:
            raise SamplerError(f"step must be >= 0, got {step}")
        out: list[int] = []
        pos = step * self.global_batch
        while len(out) < self.global_batch:
            epoch, offset = divmod(pos, self.n_samples)
            take = min(self.global_batch - len(out), self.n_samples - offset)
            out.extend(int(i) for i in self._epoch(epoch)[offset:offset + take])
            pos += take
        return out

    def replica_samples(self, step: int, local_batches: Sequence[int], replica: int) -> list[int]:
        """Replica ``replica``'s slice of ``step``'s samples: replicas in order, each its
        local batch (nonuniform); the local batches must sum to the global batch."""
        if sum(local_batches) != self.global_batch or any(b < 0 for b in local_batches):
            raise SamplerError(f"local batches {list(local_batches)} must be >= 0 and sum to the global "
                               f"batch {self.global_batch}")
        if not 0 <= replica < len(local_batches):
            raise SamplerError(f"replica {replica} is not one of {len(local_batches)}")
        start = sum(local_batches[:replica])
        return self.samples(step)[start:start + local_batches[replica]]

    def __next__(self) -> list[int]:
        """The next step's samples (and the state moves on)."""
        out = self.samples(self.step)
        self.step += 1
        return out

    def __iter__(self):
        return self

    # ---- resumable state (a checkpoint's) ----

    def state_dict(self) -> dict:
        return {"step": self.step, "n_samples": self.n_samples, "global_batch": self.global_batch,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved step; refuses a state of another dataset size, global
        batch, seed or shuffling (the sample sequence would differ)."""
        for name in ("n_samples", "global_batch", "seed", "shuffle"):
            if state.get(name) != getattr(self, name):
                raise SamplerError(f"the checkpoint's sampler has {name}={state.get(name)!r}, this "
                                   f"one {getattr(self, name)!r}: resuming would train other samples")
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise SamplerError(f"the checkpoint's sampler step is {step!r}")
        self.step = step
