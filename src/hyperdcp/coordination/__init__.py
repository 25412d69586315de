"""Cross-rank coordination: byte-level collectives with error propagation. No pickle anywhere."""

from .base import Coordinator, LocalCoordinator, run_checked

__all__ = ["Coordinator", "LocalCoordinator", "run_checked"]
