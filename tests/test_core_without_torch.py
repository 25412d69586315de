"""The core works without torch: numpy state dicts save and load in a process where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_numpy_round_trip_with_torch_unimportable(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any 'import torch' now fails
        import numpy as np
        import hyperdcp
        state = {{"w": np.arange(12, dtype=np.float32).reshape(3, 4), "meta": {{"step": 3, "name": "x"}}}}
        hyperdcp.save(state, {str(tmp_path / 'c')!r})
        back = {{"w": np.zeros((3, 4), np.float32), "meta": None}}
        hyperdcp.load(back, {str(tmp_path / 'c')!r})
        assert (back["w"] == state["w"]).all() and back["meta"] == state["meta"]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
