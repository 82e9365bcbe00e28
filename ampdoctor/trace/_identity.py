"""Tensor identity for lineage: which record produced the memory an op reads.

A key is ``(data pointer, offset, shape, stride, dtype, storage identity)``. The data pointer alone is not an
identity: the allocator hands a freed tensor's memory to the next allocation of that size, so a fresh constant
(``torch.tensor(0.)`` in an optimizer's ``_init_group``) would link to whatever scalar lived there before and
borrow its statistics. The storage identity (the address of the storage object) tells them apart as long as the
old storage object stays allocated: :class:`Pins` holds a weak reference to every storage a key was recorded for,
which keeps that small object (not its memory) alive, so no new storage can take its address during a trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

Key = tuple[Any, ...]
#: where a key holds the storage identity (hot paths index it directly; :func:`storage_id` elsewhere)
STORAGE = 5


def tensor_key(t: torch.Tensor) -> Key | None:
    """The key of ``t`` for looking up a recorded producer (``None`` for tensors without storage)."""
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, st._cdata)
    except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested, wrapper subclasses)
        return None


def storage_id(key: Key) -> int:
    """The storage identity inside a key (what writes through another view of the same memory share)."""
    return int(key[STORAGE])


class Pins:
    """Weak references to the storages keys were recorded for (see the module docstring)."""

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    def key(self, t: torch.Tensor) -> Key | None:
        """:func:`tensor_key`, its storage pinned: use it for every key that is stored.

        (:func:`tensor_key` inlined: this runs for every floating input and output of every traced op.)"""
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, st._cdata)
        except Exception:  # noqa: BLE001 - tensors without storage (sparse, nested, wrapper subclasses)
            return None
        if key[5] not in self._refs:
            try:
                self._refs[key[5]] = StorageWeakRef(st)
            except Exception:  # noqa: BLE001 - a storage without weak references gets no lineage
                return None
        return key

    def __len__(self) -> int:
        return len(self._refs)
