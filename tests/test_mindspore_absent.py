"""hyperdcp, its core and its other adapters work where MindSpore cannot be imported; only the MindSpore
adapter itself needs it (its layout maths does not)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_everything_but_the_mindspore_adapter_works_with_mindspore_unimportable(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["mindspore"] = None  # any 'import mindspore' now fails
        import numpy as np
        import hyperdcp
        from hyperdcp import adapters
        from hyperdcp.adapters import numpy, state_dict, mindspore_layout
        spec = mindspore_layout.parse_layout("w", {{"device_matrix": (2, 2), "tensor_map": (1, -1)}})
        assert mindspore_layout.local_box(spec, (4, 3), (1, 0)).offsets == (2, 0)
        state = {{"w": np.arange(12, dtype=np.float32).reshape(3, 4)}}
        hyperdcp.save(state, {str(tmp_path / 'c')!r})
        back = {{"w": np.zeros((3, 4), np.float32)}}
        hyperdcp.load(back, {str(tmp_path / 'c')!r})
        assert (back["w"] == state["w"]).all()
        assert "mindspore" in [a.module for a in adapters._registry()]
        try:
            import hyperdcp.adapters.mindspore
        except ImportError:
            print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
