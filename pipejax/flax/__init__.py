"""Flax adapters: run a sequence of Flax layers (Linen or NNX) as a GPipe pipeline.

``LinenPipeline`` is a Linen module and ``NNXPipeline`` an NNX module; both cut their layers into
stages, keep each stage's parameters on its own device, and convert to and from the plain
sequential form of the same layers. See ``docs/flax.md``.
"""

from pipejax._src.flax_layers import from_layers as from_layers
from pipejax._src.flax_layers import layers_target as layers_target
from pipejax._src.flax_layers import to_layers as to_layers
from pipejax._src.flax_linen import LinenPipeline as LinenPipeline
from pipejax._src.flax_linen import StagePartitioned as StagePartitioned
from pipejax._src.flax_nnx import NNXPipeline as NNXPipeline
from pipejax._src.flax_nnx import restack as restack
from pipejax._src.flax_nnx import unstack as unstack
from pipejax._src.flax_sharding import on_mesh as on_mesh
from pipejax._src.flax_sharding import restore_target as restore_target

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
