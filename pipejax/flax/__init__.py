"""Flax adapters: run a sequence of Flax layers (Linen or NNX) as a micro-batch pipeline
(any of pipejax's schedules).

``LinenPipeline`` is a Linen module and ``NNXPipeline`` an NNX module; both cut their layers into
stages, keep each stage's parameters on its own device, and convert to and from the plain
sequential form of the same layers. See ``docs/flax.md``.
"""

from pipejax._src.flax.linen import LinenPipeline as LinenPipeline
from pipejax._src.flax.linen_variables import StagePartitioned as StagePartitioned
from pipejax._src.flax.nnx import NNXPipeline as NNXPipeline
from pipejax._src.flax.nnx_stacking import restack as restack
from pipejax._src.flax.nnx_stacking import unstack as unstack
from pipejax._src.flax.sharding import on_mesh as on_mesh
from pipejax._src.flax.sharding import restore_target as restore_target
from pipejax._src.flax.train_state import from_layers as from_layers
from pipejax._src.flax.train_state import layers_target as layers_target
from pipejax._src.flax.train_state import to_layers as to_layers

__all__ = [
    "LinenPipeline",
    "NNXPipeline",
    "StagePartitioned",
    "from_layers",
    "layers_target",
    "on_mesh",
    "restack",
    "restore_target",
    "to_layers",
    "unstack",
]
