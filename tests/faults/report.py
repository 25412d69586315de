"""The common ending of every campaign script: print the summary, optionally save it, PASS or FAIL."""

from __future__ import annotations

import json


def finish(res: dict, json_path: str | None, bad: int, what: str = "trial(s)",
           hidden: tuple[str, ...] = ("failures",)) -> int:
    """Print ``res`` without the ``hidden`` keys, write it whole to ``json_path``; exit status 1 if ``bad``."""
    print(json.dumps({k: v for k, v in res.items() if k not in hidden}, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    print("PASS" if not bad else f"FAIL: {bad} {what}")
    return 0 if not bad else 1
