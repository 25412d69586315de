"""The save flow: :mod:`.stage` (state dict -> StagedState), :mod:`.write` (chunks -> data files through a
SaveFiles), :mod:`.flow` (the collective persist: plan, write, commit) and :mod:`.no_collectives`
(each rank alone, rank files, finalize).

Call order: ``staged = stage(state_dict, coord)``, then ``persist(coord, staged, path, opts, cache)`` on
every rank (or ``persist_alone`` on each rank, then ``finalize``).
"""

from ..results import SaveResult
from .flow import build_metadata, persist
from .stage import StagedState, check_storable, stage
from .write import WrittenFile, write_assigned, write_data_file

__all__ = ["SaveResult", "StagedState", "WrittenFile", "build_metadata", "check_storable", "persist", "stage",
           "write_assigned", "write_data_file"]
