"""The global sampler and the token sources (issue 38, data): a step's global batch is
the same whatever the layout, resuming continues the exact sample sequence, every epoch
is a permutation, and the Megatron reader reads a .bin/.idx pair written here from the
format's description (an independent writer), packed as the 1-D .npy stream is."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_trainer.data import (
    DataError,
    GlobalSampler,
    MegatronIndexed,
    SamplerError,
    TokenArray,
    open_tokens,
)

SEQ = 8


def _digest(rows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()


@pytest.fixture
def tokens(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "rows.npy"
    np.save(path, rng.integers(0, 1000, size=(37, SEQ + 1), dtype=np.int32))
    return TokenArray(path)


def test_a_steps_global_batch_is_the_same_under_every_layout(tokens):
    """1 replica x 12, 2 x 6, 3 replicas of 5+4+3 (a degraded one with a smaller local
    batch): the concatenated replica slices, as tokens, hash the same each step."""
    sampler = GlobalSampler(len(tokens), global_batch=12, seed=3)
    layouts = ([12], [6, 6], [5, 4, 3])
    for step in range(10):  # past the first epoch (37 samples)
        digests = set()
        for layout in layouts:
            ids = [i for r in range(len(layout)) for i in sampler.replica_samples(step, layout, r)]
            assert ids == sampler.samples(step)
            digests.add(_digest(tokens.batch(ids)))
        assert len(digests) == 1, step
    with pytest.raises(SamplerError, match="sum to the global batch"):
        sampler.replica_samples(0, [6, 5], 0)


def test_resuming_continues_the_exact_sample_sequence(tokens):
    whole = GlobalSampler(len(tokens), global_batch=5, seed=11)
    expected = [next(whole) for _ in range(20)]
    first = GlobalSampler(len(tokens), global_batch=5, seed=11)
    got = [next(first) for _ in range(8)]
    state = first.state_dict()
    resumed = GlobalSampler(len(tokens), global_batch=5, seed=11)  # a new process
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(12)]
    assert got == expected
    for change in ({"n_samples": 36}, {"global_batch": 4}, {"seed": 12}, {"shuffle": False}):
        other = GlobalSampler(**{"n_samples": 37, "global_batch": 5, "seed": 11, **change})
        with pytest.raises(SamplerError, match=next(iter(change))):
            other.load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), batch=st.integers(1, 17), seed=st.integers(0, 2**32 - 1), shuffle=st.booleans())
def test_every_epoch_is_a_permutation_of_the_dataset(n, batch, seed, shuffle):
    sampler = GlobalSampler(n, batch, seed=seed, shuffle=shuffle)
    stream = [i for step in range(-(-3 * n // batch)) for i in sampler.samples(step)]
    for epoch in range(3):
        assert sorted(stream[epoch * n:(epoch + 1) * n]) == list(range(n))
    if not shuffle:
        assert stream[:n] == list(range(n))


def _write_megatron(prefix, documents: list[list[int]], dtype_code: int, dtype) -> None:
    """Megatron-LM's MMIDIDX index, version 1, written from its description: magic
    'MMIDIDX\\0\\0', <Q version=1, <B dtype code, <Q sequence count, <Q document-index
    count, int32 sizes[sequences], int64 byte pointers[sequences], int64 doc_idx[]; the
    .bin holds the sequences back to back."""
    sizes = [len(d) for d in documents]
    pointers, offset = [], 0
    for s in sizes:
        pointers.append(offset)
        offset += s * np.dtype(dtype).itemsize
    doc_idx = list(range(len(documents) + 1))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())


@pytest.mark.parametrize("code, dtype", [(8, np.uint16), (4, np.int32)])
def test_the_megatron_reader_reads_an_independently_written_pair(tmp_path, code, dtype):
    rng = np.random.default_rng(code)
    documents = [list(rng.integers(0, 60000 if code == 8 else 2**31 - 1, size=int(n)))
                 for n in rng.integers(1, 30, size=12)]
    _write_megatron(tmp_path / "corpus", documents, code, dtype)
    data = open_tokens(tmp_path / "corpus", seq_len=SEQ)
    assert isinstance(data, MegatronIndexed)
    stream = [t for d in documents for t in d]
    assert len(data) == (len(stream) - 1) // SEQ
    for i in range(len(data)):
        assert data.sample(i).tolist() == stream[i * SEQ:i * SEQ + SEQ + 1]
    np.save(tmp_path / "stream.npy", np.asarray(stream, dtype=np.int64))  # the same stream as .npy
    flat = open_tokens(tmp_path / "stream.npy", seq_len=SEQ)
    assert _digest(flat.batch(range(len(flat)))) == _digest(data.batch(range(len(data))))


def test_bad_data_files_are_refused_with_their_reason(tmp_path):
    _write_megatron(tmp_path / "ok", [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], 4, np.int32)
    idx = (tmp_path / "ok.idx").read_bytes()
    cases = {
        "magic": b"NOTMEGA\x00\x00" + idx[9:],
        "version": idx[:9] + struct.pack("<Q", 2) + idx[17:],
        "dtype": idx[:17] + bytes([7]) + idx[18:],
        "truncated": idx[:40],
    }
    words = {"magic": "MMIDIDX", "version": "version 2", "dtype": "not an integer", "truncated": "promises"}
    for name, data in cases.items():
        (tmp_path / f"{name}.idx").write_bytes(data)
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
        with pytest.raises(DataError, match=words[name]):
            MegatronIndexed(tmp_path / name, SEQ)
    np.save(tmp_path / "floats.npy", np.zeros((3, 9), dtype=np.float32))
    with pytest.raises(DataError, match="integer token ids"):
        open_tokens(tmp_path / "floats.npy")
    np.save(tmp_path / "ids.npy", np.full((3, SEQ + 1), 50, dtype=np.int64))
    with pytest.raises(DataError, match="outside 0..31"):
        open_tokens(tmp_path / "ids.npy", vocab=32)
    with pytest.raises(DataError, match="needs seq_len"):
        np.save(tmp_path / "flat.npy", np.arange(100))
        open_tokens(tmp_path / "flat.npy")
    with pytest.raises(DataError, match="not a .npy"):
        open_tokens(tmp_path / "data.txt")
