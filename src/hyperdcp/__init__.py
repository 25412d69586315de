"""hyperdcp: distributed checkpoints of sharded training state.

    meta = hyperdcp.save(state_dict, "ckpt/step-100")   # every rank calls it
    hyperdcp.load(state_dict, "ckpt/step-100")          # in place, any layout
    meta = hyperdcp.read_metadata("ckpt/step-100")      # no process group needed
"""

from ._version import __version__
from .api import load, read_metadata, save
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors
from .format.metadata import Metadata
from .manager import CheckpointManager, is_checkpoint, latest_checkpoint, list_checkpoints
from .options import AsyncSaveOptions, LoadOptions, SaveOptions
from .results import ConvertResult, LoadResult, VerifyReport
from .saving import SaveResult
from .sources import open_source
from .tools.verify import verify_checkpoint

# isort: split
# last, so that no later import of a submodule rebinds the name: ``hyperdcp.async_save`` is the function
# (the package is ``hyperdcp.async_saving``)
from .async_saving import SaveFuture, async_save, finalize

__all__ = [
    "__version__",
    "save",
    "async_save",
    "finalize",
    "SaveFuture",
    "load",
    "read_metadata",
    "open_source",
    "latest_checkpoint",
    "CheckpointManager",
    "is_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "Metadata",
    "SaveOptions",
    "LoadOptions",
    "AsyncSaveOptions",
    "SaveResult",
    "LoadResult",
    "VerifyReport",
    "ConvertResult",
    *_errors,
]
