"""The tick loop: one ``lax.scan`` that runs a schedule table on the devices of the stage axis.

Everything that differs between pipelines is a small object the loop is given:

* the **devices** (:class:`MeshDevices`, :class:`LocalDevices`): where the ``D`` devices of the
  table live and how a device's output reaches the next device. On a mesh the loop runs inside
  ``jax.shard_map``, once per device, and outputs move with ``lax.ppermute``. Without a mesh the
  ``D`` devices are virtual: each tick runs them one after the other on one device and the
  "send" is a local shift. Heterogeneous stages take one Python iteration per virtual device
  (each stage function appears once); homogeneous stages run one stage per tick, on one
  device (the one stage function appears once).
* the **stages** (:class:`Heterogeneous`, :class:`Homogeneous`): how a device runs the stage
  the table names at this tick. Heterogeneous stages on a mesh pick their function with
  ``lax.switch`` on the stage index, and their activations travel in a flat
  :class:`~pipejax._src.containers.Container` so every device sends one type; homogeneous stages
  slice their row out of parameters stacked on a stage axis.

A tick of a device (:func:`device_tick`): read the micro-batch ``i`` and stage ``s`` the table
gives it; take its input (a micro-batch of ``x`` for stage 0, the activation the previous device
sent, or, for a later round of the circular schedule on device 0, the activation that waited in
the "loop" buffer); run the stage; write the last stage's output and the stage's stats into
their accumulators; send the output on. On a bubble (``i < 0``) a stage never sees a value it
was not written for, so no ``nan`` reaches a gradient: heterogeneous stages skip it (one more
switch branch), and a homogeneous stage computes on a micro-batch of ``x`` (its function is
stage 0's) and the result goes nowhere but to other bubbles (see :class:`Homogeneous`).

A training table (1F1B, ZB-H1, interleaved 1F1B: :class:`~pipejax._src.schedules.table.Schedule` with B slots)
runs in the same loop, on a mesh (:meth:`MeshDevices.loop`) and without one
(:meth:`LocalDevices.run`, the table :func:`~pipejax._src.schedules.tables.sequential_training`): its F
slot is the tick's stage computation (the training program's, :class:`Slots`), and its B and W
slots run after it in the same tick, their cotangents sent one device back. Such a program owns
its backward pass, so it is not differentiated; it is one scan with no remat wrapper.

Each checkpoint mode of a forward table is one wrapper around the device's stage computation,
and every mode but ``"except_last"`` is a single scan over all ticks (see
:func:`pipejax._src.checkpoint.phases`), so every stage function appears once in the forward
program. There is no ``custom_vjp``:
forward- and reverse-mode autodiff of every order compose with the loop. Collectives
(``ppermute``, ``psum``, ``pcast``) are never placed inside a ``cond``/``switch`` branch: a
collective that only some devices reach deadlocks.
"""

# The loop's parts, one module each; the names the rest of pipejax uses are re-exported here.
from pipejax._src.engine.collectives import put as put
from pipejax._src.engine.collectives import shift as shift
from pipejax._src.engine.collectives import sum_exact as sum_exact
from pipejax._src.engine.config import Config as Config
from pipejax._src.engine.config import Inputs as Inputs
from pipejax._src.engine.config import clip as clip
from pipejax._src.engine.config import read as read
from pipejax._src.engine.config import stage_keys as stage_keys
from pipejax._src.engine.config import take as take
from pipejax._src.engine.config import whole as whole
from pipejax._src.engine.config import write as write
from pipejax._src.engine.config import zeros as zeros
from pipejax._src.engine.entry import run as run
from pipejax._src.engine.local import LocalDevices as LocalDevices
from pipejax._src.engine.mesh import MeshDevices as MeshDevices
from pipejax._src.engine.stages import Heterogeneous as Heterogeneous
from pipejax._src.engine.stages import Homogeneous as Homogeneous
from pipejax._src.engine.stages import _row as _row
from pipejax._src.engine.stages import dispatch as dispatch
from pipejax._src.engine.table_rows import columns as columns
from pipejax._src.engine.table_rows import loop_delay as loop_delay
from pipejax._src.engine.table_rows import pool_columns as pool_columns
from pipejax._src.engine.table_rows import read_row as read_row
from pipejax._src.engine.table_rows import rows as rows
from pipejax._src.engine.table_rows import table as table
from pipejax._src.engine.tick import Carry as Carry
from pipejax._src.engine.tick import Slots as Slots
from pipejax._src.engine.tick import _Ctx as _Ctx
from pipejax._src.engine.tick import _port as _port
from pipejax._src.engine.tick import _scan as _scan
from pipejax._src.engine.tick import at as at
from pipejax._src.engine.tick import at_device as at_device
from pipejax._src.engine.tick import device_tick as device_tick

__all__: tuple[str, ...] = ()
