"""A symbol table's chains are numbered once per distinct encoding, in the order they first
appear, across the profiles of a process: what the rewrite and its cached answers rely on.

The oracle below is the store's numbering as it was written first, one chain at a time in
Python; the store now does it with dict and map in C, and must number exactly alike."""

from __future__ import annotations

import random

import numpy as np
import pytest

from symbolize.chains import ChainStore, FrameColumns, FunctionIds, FunctionKey, encode_lines

KEYS = 400
# Few functions and lines, so that distinct keys often have chains encoded alike.
FUNCTIONS: list[FunctionKey] = [(f"f{i}", f"f{i}", "a.c" if i % 2 else "", i) for i in range(6)]


def _chain_of(key: int) -> list[tuple[int, int, int]]:
    """Key -> its frames (function index, line, column), innermost first: fixed per key, as a
    table's are, with many keys sharing one."""
    rng = random.Random(key % 97)
    return [(rng.randrange(len(FUNCTIONS)), rng.randrange(3), rng.randrange(2))
            for _ in range(1 + rng.randrange(3))]


def _resolve(keys: np.ndarray) -> FrameColumns:
    owner, function, line, column = [], [], [], []
    for chain, key in enumerate(keys.tolist()):
        for f, n, c in _chain_of(key):
            owner.append(chain)
            function.append(f)
            line.append(n)
            column.append(c)
    return FrameColumns(chains=len(keys), owner=np.array(owner, dtype=np.int64),
                        function=np.array(function, dtype=np.int64),
                        line=np.array(line, dtype=np.uint64),
                        column=np.array(column, dtype=np.uint64), functions=FUNCTIONS)


class _Oracle:
    """The numbering, a chain at a time: by each key's encoding, new ones in order."""

    def __init__(self, ids: FunctionIds) -> None:
        self._ids = ids
        self._known: dict[bytes, int] = {b"": 0}
        self._by_key: dict[int, int] = {0: 0}

    def numbers(self, keys: list[int]) -> list[int]:
        fresh = sorted({k for k in keys if k not in self._by_key})
        if fresh:
            frames = _resolve(np.array(fresh, dtype=np.int64))
            fids = self._ids.ids_of(frames.functions)[frames.function]
            encoded = encode_lines(frames.owner, fids, frames.line, frames.column, len(fresh))
            for key, enc in zip(fresh, encoded, strict=True):
                self._by_key[key] = self._known.setdefault(enc, len(self._known))
        return [self._by_key[k] for k in keys]


@pytest.mark.parametrize("seed", range(6))
def test_chains_encoded_alike_share_a_number_given_in_order_of_first_appearance(
        seed: int) -> None:
    rng = random.Random(seed)
    ids = FunctionIds()
    store, oracle = ChainStore(ids, keys=KEYS), _Oracle(ids)
    for _profile in range(4):  # later profiles meet known keys, new keys, and known chains
        keys = [rng.choice((0, rng.randrange(1, KEYS))) if rng.random() < 0.1
                else rng.randrange(1, KEYS) for _ in range(rng.randrange(1, 300))]
        with ids.session():
            chains = store.chains(np.array(keys, dtype=np.int64), _resolve)
        assert chains.numbers.tolist() == oracle.numbers(keys)
        # Each number's frames are its keys' own.
        at, owners = chains._frames_of(chains.numbers)
        for i, key in enumerate(keys):
            mine = at[owners == i]
            want = _chain_of(key) if key else []
            assert chains._c.lines[mine].tolist() == [n for _f, n, _c in want]
            assert chains._c.columns[mine].tolist() == [c for _f, _n, c in want]
            assert [ids.key_of(int(f)) for f in chains._c.function_ids[mine]] \
                == [FUNCTIONS[f] for f, _n, _c in want]


def test_a_batch_of_one_key_and_of_keys_all_known() -> None:
    ids = FunctionIds()
    store = ChainStore(ids, keys=KEYS)
    with ids.session():
        one = store.chains(np.array([5], dtype=np.int64), _resolve).numbers.tolist()
        again = store.chains(np.array([5, 0, 5], dtype=np.int64), _resolve).numbers.tolist()
    assert one == [1] and again == [1, 0, 1]
