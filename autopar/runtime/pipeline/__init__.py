"""Running pipelined plans: the staged programs a driver prepares, run stage by stage.

- ``eager.py``: ``PipelinedModule``, the pipeline axis alone: each stage interprets its slice of the
  captured graph eagerly on torch's ``PipelineStage`` and schedules;
- ``sharded.py``: ``MeshPipelinedModule``, other mesh axes too: each stage runs its slice of the plan's
  lowered sharded program (a ``program.staged.StagedProgram``);
- ``simulate.py``: ``simulate_staged``, every stage-mesh device a thread of this process;
- ``schedule.py``: what the runtimes share (micro-batch slices, torch's schedules, one step);
- ``loss.py``: each micro-batch loss's weight in the step's loss; ``state.py``: what a rank holds.

The names below are re-exported for code that imported them from the modules this package replaces.
"""

from autopar.runtime.pipeline.eager import PipelinedModule, check_alone
from autopar.runtime.pipeline.loss import loss_weights
from autopar.runtime.pipeline.schedule import ScheduleStep, batch_size, micro_slices, run_schedule, take_loss
from autopar.runtime.pipeline.sharded import MeshPipelinedModule
from autopar.runtime.pipeline.simulate import simulate_staged
from autopar.runtime.pipeline.state import (
    drop_parameters,
    held_params,
    keep_stage_parameters,
    local_state,
    refuse_buffer_updates,
    without_dropped,
)

__all__ = ["MeshPipelinedModule", "PipelinedModule", "ScheduleStep", "batch_size", "check_alone", "drop_parameters",
           "held_params", "keep_stage_parameters", "loss_weights", "local_state", "micro_slices",
           "refuse_buffer_updates", "run_schedule", "simulate_staged", "take_loss", "without_dropped"]
