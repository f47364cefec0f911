"""Data parallelism over every device, on one process or many.

JAX's own SPMD runtime does the work: a mesh with one axis, ``data``, over all
devices (``jax.make_mesh``); batches split along it; the train state
replicated on it or, with ``config.mesh.shard_params`` (FSDP), split along it
too. ``jit`` with these shardings runs one program on every device, and XLA
inserts the collectives (the all-reduce of the gradients, the all-gathers of
FSDP parameters). With one device the mesh has one device and nothing else
changes.

Several processes (a TPU pod slice, several GPU hosts) call
:func:`initialize_distributed` first; then ``jax.devices()`` lists every
process's devices, the mesh spans them all, and each process holds only its
share of a batch:

    mesh = make_mesh()
    sharding = batch_sharding(mesh)
    rows = process_rows(sharding, 128)  # this process's rows of each batch
    batch = global_batch({"inputs": inputs[rows]}, sharding, 128)
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mha import data

DATA_AXIS = "data"


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins this process to a multi-process run (``jax.distributed``).

  Call it before anything else touches JAX. What is not given comes from the
  environment: ``JAX_COORDINATOR_ADDRESS``, or the cluster's own variables
  (Cloud TPU, SLURM, Open MPI, Kubernetes), as ``jax.distributed.initialize``
  detects them. On CPU, the processes exchange data through gloo.
  """
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def is_main_process() -> bool:
  """Whether this process writes side files, logs and prints (process 0)."""
  return jax.process_index() == 0


def make_mesh(size: int = -1) -> Mesh:
  """The mesh of one ``data`` axis over ``size`` devices (-1: all of them).

  Raises:
    ValueError: ``size`` is neither -1 nor the number of devices.
  """
  num_devices = jax.device_count()
  if size not in (-1, num_devices):
    raise ValueError(f"a data axis of {size} devices does not match the "
                     f"{num_devices} device{'s' * (num_devices != 1)} of this "
                     "run")
  # Auto: XLA propagates the shardings given at the jit boundary.
  return jax.make_mesh((num_devices,), (DATA_AXIS,),
                       axis_types=(AxisType.Auto,))


def data_size(mesh: Mesh) -> int:
  """The number of devices along the data axis."""
  return mesh.shape[DATA_AXIS]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split along the data axis."""
  return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device."""
  return NamedSharding(mesh, P())


def fsdp_spec(shape: tuple[int, ...], num_shards: int) -> P:
  """Splits the largest dimension that ``num_shards`` divides (big_vision's
  FSDP rule); replicates a scalar or an array no dimension of which divides."""
  if num_shards > 1:
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
      if shape[dim] % num_shards == 0:
        return P(*[None] * dim, DATA_AXIS)
  return P()


def state_shardings(abstract_state: Any, mesh: Mesh, *,
                    shard_params: bool) -> Any:
  """The sharding of each leaf of a train state (``jax.eval_shape`` output):
  replicated, or with ``shard_params`` split by :func:`fsdp_spec` (the
  optimizer's moments have the parameters' shapes, so they follow them)."""
  if not shard_params:
    return jax.tree.map(lambda _: replicated(mesh), abstract_state)
  return jax.tree.map(
      lambda x: NamedSharding(mesh, fsdp_spec(x.shape, data_size(mesh))),
      abstract_state)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves of ``abstract`` carrying ``shardings``:
  the target an orbax restore lays the arrays out in, whatever the device
  count they were saved with."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abstract, shardings)


@functools.lru_cache(maxsize=64)
def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
  """The rows of a global batch of ``batch_size`` that this process holds.

  Raises:
    ValueError: the devices do not divide ``batch_size``.
  """
  num_shards = sharding.mesh.shape[DATA_AXIS]
  if batch_size % num_shards:
    raise ValueError(f"a batch of {batch_size} does not split across "
                     f"{num_shards} devices")
  indices = sharding.addressable_devices_indices_map((batch_size,)).values()
  start = min(index[0].start or 0 for index in indices)
  stop = max(batch_size if index[0].stop is None else index[0].stop
             for index in indices)
  if stop - start != len(indices) * (batch_size // num_shards):
    raise ValueError(f"the devices of process {jax.process_index()} hold no "
                     "contiguous block of rows")
  return slice(start, stop)


def global_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding,
                 batch_size: int) -> dict[str, jax.Array]:
  """Global arrays of ``batch_size`` rows (split as ``sharding``,
  :func:`batch_sharding`) from this process's rows (:func:`process_rows`).
  With one process, ``local`` is the whole batch (and this is one
  ``jax.device_put``)."""
  return jax.make_array_from_process_local_data(
      sharding, dict(local),
      {key: (batch_size, *value.shape[1:]) for key, value in local.items()})


def padded_batch_size(batch_size: int, mesh: Mesh) -> int:
  """``batch_size`` rounded up to a multiple of the data axis."""
  return -(-batch_size // data_size(mesh)) * data_size(mesh)


def eval_batch_rows(batch_size: int, num_examples: int, mesh: Mesh) -> int:
  """The rows of each evaluation batch of a split of ``num_examples``:
  ``batch_size``, but no more than the split fills, rounded up to a multiple
  of the data axis. (An ``eval_batch_size`` of 10**8 on a split of 64 would
  otherwise pad each batch to 10**8 rows; a size up to the split's is
  unchanged.)"""
  return padded_batch_size(max(1, min(batch_size, num_examples)), mesh)


def eval_batches(split: data.Split, batch_size: int,
                 mesh: Mesh) -> Iterator[dict[str, jax.Array]]:
  """:func:`mha.data.eval_batches` as global arrays split along the data axis.

  The batch size is capped at the split's size and rounded up to a multiple
  of the data axis (:func:`eval_batch_rows`; padding rows have no valid
  token: they count nothing in metric sums).
  """
  size = eval_batch_rows(batch_size, len(split), mesh)
  sharding = batch_sharding(mesh)
  rows = process_rows(sharding, size)
  for batch in data.eval_batches(split, size):
    yield global_batch({k: v[rows] for k, v in batch.items()}, sharding, size)
