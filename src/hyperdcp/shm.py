"""Deprecated: shared-memory naming, reclaim and SIGTERM cleanup moved to :mod:`hyperdcp.coordination.shm`.

This module is that module (an alias in ``sys.modules``), so reading or setting its attributes acts on
the real one.
"""

import sys

from .coordination import shm as _shm

sys.modules[__name__] = _shm
