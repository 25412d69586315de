"""Exchanged read-once plans, decoded and checked as arrays, kept only for the chunks a host needs.

When layouts are not grids every rank sends its plan (:func:`~.read_once.encode_plan`: tensor index,
chunk index and box coordinates as integer arrays). :func:`plans_to_wants` decodes all of them at
once, validates them with vectorised checks (a malformed plan raises naming its rank), and returns
the :class:`~.read_once_wants.Wants` of the chunks the given ranks need; nothing else is kept.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core import wire
from ..core.boxes import Box
from ..errors import MismatchError
from ..format.metadata import Metadata
from .read_once_wants import Wants

_PLAN_VERSION = 1


def _bad(rank: int, why: str) -> MismatchError:
    return MismatchError(f"read-once: the load plan of rank {rank} is malformed ({why}); do all ranks run the same "
                         "hyperdcp version?")


def plans_to_wants(meta: Metadata, raws: Sequence[bytes], ranks: Sequence[int]) -> Wants:
    """Every rank's encoded plan -> the wants of the chunks ``ranks`` need (piece numbers for all)."""
    names = list(meta.tensors)
    metas = [meta.tensors[n] for n in names]
    ndims = np.asarray([len(t.shape) for t in metas], np.int64)
    nchunks = np.asarray([len(t.chunks) for t in metas], np.int64)
    ts, cs, bs, rk = [], [], [], []
    for r, raw in enumerate(raws):
        try:
            head, arrs = wire.unpack(raw)
            if not isinstance(head, dict) or head.get("v") != _PLAN_VERSION:
                raise ValueError(f"plan version {head.get('v') if isinstance(head, dict) else head!r}")
            t, c, b = (np.asarray(arrs[k]).astype(np.int64, copy=False).reshape(-1) for k in ("t", "c", "b"))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _bad(r, str(e)) from None
        if len(t) != int(head.get("n", -1)) or len(c) != len(t):
            raise _bad(r, "array lengths differ")
        if len(t) and (t.min() < 0 or t.max() >= len(names)):
            raise _bad(r, f"piece refers to tensor {int(t[(t < 0) | (t >= len(names))][0])}, not in the checkpoint")
        if int(2 * ndims[t].sum()) != len(b):
            raise _bad(r, "box coordinates do not match the pieces")
        ts.append(t)
        cs.append(c)
        bs.append(b)
        rk.append(np.full(len(t), r, np.int64))
    T = np.concatenate(ts) if ts else np.zeros(0, np.int64)
    C = np.concatenate(cs) if cs else np.zeros(0, np.int64)
    Bflat = np.concatenate(bs) if bs else np.zeros(0, np.int64)
    R = np.concatenate(rk) if rk else np.zeros(0, np.int64)
    E = np.concatenate([np.arange(len(t)) for t in ts]) if ts else np.zeros(0, np.int64)
    if len(C) and ((C < 0) | (C >= nchunks[T])).any():
        i = int(np.nonzero((C < 0) | (C >= nchunks[T]))[0][0])
        raise _bad(int(R[i]), f"piece refers to tensor {int(T[i])} chunk {int(C[i])}, not in the checkpoint")
    start = np.concatenate([[0], np.cumsum(2 * ndims[T])[:-1]]).astype(np.int64) if len(T) else np.zeros(0, np.int64)
    key = T * (int(nchunks.max()) + 1 if len(nchunks) else 1) + C
    mine = np.isin(R, np.asarray(sorted(ranks), np.int64))
    keep = np.isin(key, np.unique(key[mine]))
    total = 0
    out = Wants(len(raws), 0, {}, frozenset(ranks))
    for ti in np.unique(T).tolist():  # per tensor: checks and wants as arrays
        sel = np.nonzero(T == ti)[0]
        nd = int(ndims[ti])
        ch = metas[ti].chunks
        coords = Bflat[start[sel, None] + np.arange(2 * nd)] if nd else np.zeros((len(sel), 0), np.int64)
        off, ln = coords[:, :nd], coords[:, nd:]
        c = C[sel]
        c_off, c_end = (np.asarray(ch.offsets)[c].reshape(len(sel), nd),
                        (np.asarray(ch.offsets) + np.asarray(ch.lengths))[c].reshape(len(sel), nd))
        bad = (ln <= 0).any(axis=1) | (off < c_off).any(axis=1) | (off + ln > c_end).any(axis=1)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise _bad(int(R[sel[i]]),
                       f"box {Box(tuple(off[i].tolist()), tuple(ln[i].tolist()))} of {names[ti]!r} is not "
                                       f"inside chunk {ch.box(int(c[i]))}")
        uc = np.unique(c)
        total += int((np.asarray(ch.end)[uc] - np.asarray(ch.begin)[uc]).sum())
        k = keep[sel]
        if not k.any():
            continue
        sel, c, off, ln = sel[k], c[k], off[k], ln[k]
        order = np.lexsort((R[sel], *(ln.T[::-1]), *(off.T[::-1]), c))
        rows = np.concatenate([c[:, None], off, ln], axis=1)[order]
        rr, ee = R[sel][order], E[sel][order]
        cut = np.nonzero((rows[1:] != rows[:-1]).any(axis=1))[0] + 1 if len(rows) > 1 else np.zeros(0, np.int64)
        for a, b in zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [len(rows)]]).tolist()):
            row = rows[a].tolist()
            box = Box(tuple(row[1:1 + nd]), tuple(row[1 + nd:]))
            out.chunks.setdefault((ti, row[0]), []).append((box, rr[a:b].copy(), ee[a:b].tolist()))
    out.total = total
    return out
