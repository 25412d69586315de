"""One checkpoint format for torch and MindSpore: bit-exact round trips between the two, bf16 included.

The scenario, with one spawn of 2 torch gloo ranks:

1. MindSpore saves a Cell's parameters (nn.SequentialCell of nn.Dense, trained one step) and a bf16
   tensor; the torch ranks load that checkpoint into an FSDP2 model of the same architecture
   (``nn.Linear`` keeps weights as (out, in) like ``nn.Dense``, and the names agree) and a Shard(0) bf16
   DTensor, and compare every byte.
2. The torch ranks train one step under FSDP2 and save; MindSpore loads that checkpoint into a fresh
   Cell's Parameters (in place), into a bf16 tensor, and into the slices of a MindSpore layout (4 devices,
   one slice per simulated rank), each compared byte for byte with what torch saved.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from hyperdcp.adapters import mindspore as msa  # noqa: E402
from hyperdcp.adapters import mindspore_layout as msl  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.ms_workers.torch_side import SHAPES, bf16_words, torch_round  # noqa: E402

msa.prime()
nn = ms.nn


def cell(seed: int):
    ms.set_seed(seed)
    return nn.SequentialCell([nn.Dense(3, 8), nn.ReLU(), nn.Dense(8, 2)])


def bf16(words: np.ndarray):
    return ms.Tensor.from_numpy(np.ascontiguousarray(words)).view(ms.bfloat16)


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xfw")
    net = cell(seed=3)
    words = bf16_words(20, seed=2).reshape(4, 5)
    hyperdcp.save({"model": net.parameters_dict(), "bf": bf16(words)}, tmp / "from_ms")
    want_ms = {k: v.asnumpy().copy() for k, v in net.parameters_dict().items()}
    want_ms["bf"] = words
    out = run_ranks(2, torch_round, str(tmp / "from_ms"), str(tmp / "from_torch"), want_ms, timeout=120)
    return tmp, out


def test_a_mindspore_save_loads_into_torch_fsdp2_bit_exact(exchanged):
    _, out = exchanged
    assert [o["loaded_ok"] for o in out] == [True, True]


def test_a_torch_fsdp2_save_loads_into_a_mindspore_cell_in_place_bit_exact(exchanged):
    tmp, out = exchanged
    saved = out[0]["saved"]
    net = cell(seed=9)
    params = net.parameters_dict()
    ids = {k: id(p) for k, p in params.items()}
    back = bf16(np.zeros((6, 4), np.int16))
    hyperdcp.load({"model": params, "bf": back}, tmp / "from_torch")
    for k, p in net.parameters_dict().items():
        assert id(p) == ids[k] and p.dtype == ms.float32
        assert p.asnumpy().tobytes() == saved[k].tobytes(), k
    assert back.dtype == ms.bfloat16 and back.view(ms.int16).asnumpy().tobytes() == out[0]["bf"].tobytes()


def test_a_torch_fsdp2_save_loads_into_the_slices_of_a_mindspore_layout(exchanged):
    tmp, out = exchanged
    saved = out[0]["saved"]["0.weight"]  # (8, 3): 8 rows split over "mp" (4), replicated over "dp" (2)
    layout = ms.parallel.Layout((2, 4), ("dp", "mp"))("mp", "None")
    spec = msl.parse_layout("model.0.weight", layout)
    for rank in range(8):
        part = ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name="0.weight")
        hyperdcp.load({"model": {"0.weight": msa.Sharded(part, layout, rank=rank)}}, tmp / "from_torch",
                      strict=False)
        box = msl.local_box(spec, SHAPES["0.weight"], msl.coordinate(spec, rank))
        assert box.offsets == (2 * (rank % 4), 0)
        assert part.asnumpy().tobytes() == np.ascontiguousarray(saved[2 * (rank % 4):2 * (rank % 4) + 2]).tobytes()
