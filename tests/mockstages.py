"""Process-group-free stand-ins for PipelineStage, as torch's own schedule tests use."""

from __future__ import annotations

from seq1f1b._runtime import StandInStage as MockStage
from seq1f1b._runtime import stand_in_stages as mock_stages

__all__ = ["MockStage", "mock_stages"]
