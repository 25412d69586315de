"""hyperdcp: distributed checkpoints of sharded training state.

    meta = hyperdcp.save(state_dict, "ckpt/step-100")   # every rank calls it
    hyperdcp.load(state_dict, "ckpt/step-100")          # in place, any layout
    meta = hyperdcp.read_metadata("ckpt/step-100")      # no process group needed
"""

from ._version import __version__
from .api import load, read_metadata, save
from .async_save import AsyncSaveError, PersistProcessDiedError, SaveFuture, SaveInProgressError, async_save
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors
from .format.metadata import Metadata
from .results import ConvertResult, LoadResult, VerifyReport
from .manager import latest_checkpoint, list_checkpoints
from .options import LoadOptions, SaveOptions
from .saving import SaveResult
from .sources import open_source
from .tools.verify import verify_checkpoint

__all__ = [
    "__version__",
    "save",
    "async_save",
    "SaveFuture",
    "AsyncSaveError",
    "PersistProcessDiedError",
    "SaveInProgressError",
    "load",
    "read_metadata",
    "open_source",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "Metadata",
    "SaveOptions",
    "LoadOptions",
    "SaveResult",
    "LoadResult",
    "VerifyReport",
    "ConvertResult",
    *_errors,
]
