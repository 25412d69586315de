"""One msrun worker: save a MindSpore-sharded state under one layout, load it under another, check it.

    msrun --worker_num=N ... reshard.py CKPT_DIR OUT_DIR

Every rank holds its slice of three parameters under the save layouts (a 2-d device matrix sharding
both dims, a tuple tensor-map entry, a replicated float16 tensor with a NaN payload and -0); after the
collective save, every rank loads into slices of a different layout and compares with the full values
it can compute itself, then into whole tensors. It then calls a load that fails on rank 1 only (a wrong shape there) and
records that every rank raised.

No bf16 here: its bitcast makes this MindSpore wheel probe numpy's C API, which fails under numpy 2 and
then spoils the worker's exit handshake with msrun's scheduler (docs/MINDSPORE.md); bf16 is covered on
one process and across frameworks.
"""

import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore.communication import init, release

import hyperdcp
from hyperdcp.adapters.mindspore import Sharded
from hyperdcp.adapters.mindspore_layout import coordinate, local_box, parse_layout
from hyperdcp.coordination import default_coordinator
from hyperdcp.coordination.mindspore_dist import MindSporeCoordinator

ckpt, out = sys.argv[1], sys.argv[2]
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
coord = MindSporeCoordinator()
assert isinstance(default_coordinator(), MindSporeCoordinator)  # picked by default after init()
rank, world = coord.rank, coord.world_size

FULL = {"w": np.arange(8 * 12, dtype=np.float32).reshape(8, 12) - 7.5,
        "e": (np.arange(16 * 4, dtype=np.int32).reshape(16, 4) * 3 - 50),
        "b": np.array([0x3E00, 0xBE00, 0x7E01, 0x8000, 0x7C00, 1], np.uint16).view(np.float16)}  # NaN payload, -0
SAVE = {"w": ((2, world // 2), (1, 0)), "e": ((2, world // 2), ((1, 0), -1)), "b": ((world,), (-1,))}
LOAD = {"w": ((world,), (-1, 0)), "e": ((world // 2, 2), (0, -1)), "b": ((world // 2, 2), (-1,))}


def slices(layouts, fill):
    state = {}
    for name, (dev, tmap) in layouts.items():
        spec = parse_layout(name, {"device_matrix": dev, "tensor_map": tmap})
        box = local_box(spec, FULL[name].shape, coordinate(spec, rank))
        sl = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))
        part = FULL[name][sl] if fill else np.zeros(box.lengths, FULL[name].dtype)
        t = ms.Tensor.from_numpy(np.ascontiguousarray(part))
        state[name] = Sharded(ms.Parameter(t, name=name) if name != "b" else t,
                              {"device_matrix": dev, "tensor_map": tmap}), sl
    return state


saved = slices(SAVE, fill=True)
hyperdcp.save({k: v for k, (v, _) in saved.items()}, ckpt, coordinator=coord)
loaded = slices(LOAD, fill=False)
hyperdcp.load({k: v for k, (v, _) in loaded.items()}, ckpt, coordinator=coord)
ok = {}
for name, (sh, sl) in loaded.items():
    ok[name] = sh.local.asnumpy().tobytes() == np.ascontiguousarray(FULL[name][sl]).tobytes()
whole = {k: ms.Parameter(ms.Tensor(np.zeros_like(v)), name=k) for k, v in FULL.items()}
hyperdcp.load(whole, ckpt)  # the default coordinator; every rank: the full tensors, from everyone's slices
ok["whole"] = all(whole[k].asnumpy().tobytes() == FULL[k].tobytes() for k in FULL)
bad = {"w": Sharded(ms.Parameter(ms.Tensor(np.zeros((8, 12 // world + (rank == 1)), np.float32)), name="w"),
                    {"device_matrix": (world,), "tensor_map": (-1, 0)})}
raised = "skipped"
if os.environ.get("SKIPBAD") != "1":
  try:
    hyperdcp.load(bad, ckpt, coordinator=coord)
    raised = ""
  except hyperdcp.CheckpointError as e:
    raised = type(e).__name__ + ": " + str(e)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "ok": ok, "raised": raised}, f)
release()  # tell msrun's scheduler this worker is done (else it waits for a heartbeat timeout)
