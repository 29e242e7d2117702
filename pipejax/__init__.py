"""pipejax: micro-batch pipeline parallelism (GPipe, circular, 1F1B, ZB-H1 and interleaved 1F1B
schedules in one SPMD program), deterministic checkpointing and higher-order derivatives for JAX,
as pure composable functions."""

from pipejax._src.balance import Balance as Balance
from pipejax._src.balance import Partition as Partition
from pipejax._src.balance import balance as balance
from pipejax._src.balance import balance_costs as balance_costs
from pipejax._src.balance import layer_costs as layer_costs
from pipejax._src.balance import partition as partition
from pipejax._src.batchnorm import BatchStats as BatchStats
from pipejax._src.batchnorm import Moments as Moments
from pipejax._src.batchnorm import batch_norm as batch_norm
from pipejax._src.batchnorm import batch_norm_init as batch_norm_init
from pipejax._src.batchnorm import batch_norm_update as batch_norm_update
from pipejax._src.batchnorm import merge_moments as merge_moments
from pipejax._src.batchnorm import moments as moments
from pipejax._src.checkpoint import MODES as CHECKPOINT_MODES
from pipejax._src.checkpoint import checkpoint_sequential as checkpoint_sequential
from pipejax._src.keys import key_for as stage_key
from pipejax._src.keys import layer_key as layer_key
from pipejax._src.memory import MemoryEstimate as MemoryEstimate
from pipejax._src.memory import MemoryReport as MemoryReport
from pipejax._src.memory import Residual as Residual
from pipejax._src.memory import memory_estimate as memory_estimate
from pipejax._src.memory import memory_report as memory_report
from pipejax._src.microbatch import Plan as MicrobatchPlan
from pipejax._src.microbatch import merge as merge_microbatches
from pipejax._src.microbatch import plan as microbatch_plan
from pipejax._src.microbatch import split as split_microbatches
from pipejax._src.params.layer_form import from_layers as from_layers
from pipejax._src.params.layer_form import layers_target as layers_target
from pipejax._src.params.layer_form import to_layers as to_layers
from pipejax._src.params.placement import StageParams as StageParams
from pipejax._src.pipeline import Pipeline as Pipeline
from pipejax._src.pipeline import StageFn as StageFn
from pipejax._src.pipeline import StatefulStageFn as StatefulStageFn
from pipejax._src.pipeline import pipeline as pipeline
from pipejax._src.planner import Candidate as PlanCandidate
from pipejax._src.planner import PipelinePlan as PipelinePlan
from pipejax._src.planner import plan_pipeline as plan_pipeline
from pipejax._src.random import dropout as dropout
from pipejax._src.schedules.actions import Action as ScheduleAction
from pipejax._src.schedules.actions import from_actions as schedule_from_actions
from pipejax._src.schedules.table import Schedule as Schedule
from pipejax._src.schedules.tables import TrainingSchedule as TrainingSchedule  # = Schedule; not in __all__
from pipejax._src.schedules.tables import circular as circular_schedule
from pipejax._src.schedules.tables import circular_bubble_fraction as circular_bubble_fraction
from pipejax._src.schedules.tables import gpipe as gpipe_schedule
from pipejax._src.schedules.tables import gpipe_bubble_fraction as gpipe_bubble_fraction
from pipejax._src.schedules.tables import interleaved_one_f_one_b as interleaved_one_f_one_b_schedule
from pipejax._src.schedules.tables import one_f_one_b as one_f_one_b_schedule
from pipejax._src.schedules.tables import sequential as sequential_schedule
from pipejax._src.schedules.tables import v_half as v_half_schedule
from pipejax._src.schedules.tables import v_half_bubble_fraction as v_half_bubble_fraction
from pipejax._src.schedules.tables import zb_floor as zb_floor_schedule
from pipejax._src.schedules.tables import zb_h1 as zb_h1_schedule
from pipejax._src.schedules.tables import zb_h1_bubble_fraction as zb_h1_bubble_fraction
from pipejax._src.schedules.tables import zb_v as zb_v_schedule
from pipejax._src.schedules.timeline import inputs_held as timeline_inputs_held
from pipejax._src.training.loss import LossSums as LossSums
from pipejax._src.training.loss import weighted_mean as weighted_mean

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT_MODES",
    "Balance",
    "BatchStats",
    "LossSums",
    "MemoryEstimate",
    "MemoryReport",
    "MicrobatchPlan",
    "Moments",
    "Partition",
    "Pipeline",
    "PipelinePlan",
    "PlanCandidate",
    "Residual",
    "Schedule",
    "ScheduleAction",
    "StageFn",
    "StageParams",
    "StatefulStageFn",
    "balance",
    "balance_costs",
    "batch_norm",
    "batch_norm_init",
    "batch_norm_update",
    "checkpoint_sequential",
    "circular_bubble_fraction",
    "circular_schedule",
    "dropout",
    "from_layers",
    "gpipe_bubble_fraction",
    "gpipe_schedule",
    "interleaved_one_f_one_b_schedule",
    "layer_costs",
    "layer_key",
    "layers_target",
    "memory_estimate",
    "memory_report",
    "merge_microbatches",
    "merge_moments",
    "microbatch_plan",
    "moments",
    "one_f_one_b_schedule",
    "partition",
    "pipeline",
    "plan_pipeline",
    "schedule_from_actions",
    "sequential_schedule",
    "split_microbatches",
    "stage_key",
    "timeline_inputs_held",
    "to_layers",
    "v_half_bubble_fraction",
    "v_half_schedule",
    "weighted_mean",
    "zb_floor_schedule",
    "zb_h1_bubble_fraction",
    "zb_h1_schedule",
    "zb_v_schedule",
]
