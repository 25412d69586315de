"""Deprecated: read-once loads moved to :mod:`hyperdcp.planning.read_once` (plans, schedule, placement:
pure) and :mod:`hyperdcp.loading.read_once` (running it); segments to :mod:`hyperdcp.coordination.shm`.

The names tests and benches used are re-exported here. To replace a function the load calls (a spy in a
test), set it on :mod:`hyperdcp.loading.read_once`, where it is looked up.
"""

from .coordination.shm import _LIVE, host_key, shm_enabled  # noqa: F401
from .coordination.shm import SHM_DIR as _SHM_DIR  # noqa: F401
from .coordination.shm import Segment as _Segment  # noqa: F401
from .loading.read_once import _Exchange, _messages, _Msg, read_once  # noqa: F401
from .planning.read_once import (  # noqa: F401
    Need,
    Schedule,
    ShmLayout,
    Unit,
    broadcast_groups,
    build_schedule,
    decode_plan,
    derive_plans,
    encode_plan,
    layout_digest,
    mark_broadcasts,
    shm_layout,
)
