"""BandDataset: training samples of this rank's band, for a torch DataLoader (also with worker processes)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xarray as xr

from ..manager import DomainParallelManager
from ..partition import band_range
from ..validation import check_int
from ._store import (
    agree,
    check_complete,
    check_dim,
    close_quietly,
    describe,
    domain_layout,
    grid_position,
    open_store,
    resolve_manager,
    store_name,
    values_digest,
)

__all__ = ["BandDataset"]


class BandDataset(torch.utils.data.Dataset):
    """Samples of a time series store, this rank's band only.

    Sample ``i`` (of the times selected by ``time_slice``) is a dict:

    * ``"x"``: the ``history`` times ``i .. i + history - 1``, shape
      ``(C, history, H_band, W)``;
    * ``"y"``: the ``forecast`` times that follow, ``(C, forecast, H_band, W)``
      (left out when ``forecast=0``);
    * ``"static"``: ``static_variables`` (no time dimension), ``(C_s, 1, H_band, W)``;
    * ``"index"``: ``i``.

    Channels ``C`` are the ``variables`` in order, each flattened over its
    dimensions other than time, ``dim`` and its last (e.g. an ERA5 ``t`` on
    13 levels gives 13 channels, a surface field one). These are exactly
    the rows that ``credit_mpi.shard_batch(global_sample, uneven=uneven)``
    gives (per sample, and per batch after the ``DataLoader`` stacks a batch
    dimension: ``x``/``y``/``static`` are sharded at dim -2, ``index`` is left
    alone), reading only the chunks that overlap the band.

    On a latitude x longitude domain grid (``domain_grid=(rows, cols)``,
    ``cols > 1``) the samples are the rank's block: the latitude band of its
    grid row and the band of its grid column along the last dim (``W_block``),
    as ``shard_batch`` with the (latitude, longitude) dims gives.

    Construction is collective over the domain group (the ranks agree on the
    store, the variables and every argument, as :func:`open_band`; a store
    that :func:`write_bands` did not finish is refused).
    ``__getitem__`` calls no MPI: it opens the store with xarray (once per
    process) and reads. Pickled (``DataLoader`` workers with ``spawn`` or
    ``forkserver``), the dataset unpickles without initialising MPI in the
    worker; see :meth:`sampler` for data-parallel replicas.

    Args:
        store: As :func:`open_band` (a path, a zarr store object, netCDF
            file(s); an opened Dataset works in the main process only).
        variables: Names of the time-dependent variables, in channel order.
        manager: The domain-parallel manager (default: the singleton).
        dim: The dimension cut into bands.
        time_dim: The time dimension.
        history: Input times per sample (>= 1).
        forecast: Target times per sample (>= 0).
        static_variables: Variables without ``time_dim`` (``"static"``).
        time_slice: Which times to use: a slice of positions (ints) or of
            labels (e.g. ``slice("2000", "2010")``); default all.
        uneven: As :func:`open_band`.
        dtype: numpy dtype of the tensors (default: the variables' common type).
        open_kwargs: Passed to the xarray open function.
    """

    def __init__(
        self,
        store: Any,
        variables: Sequence[str],
        manager: DomainParallelManager | None = None,
        *,
        dim: str = "latitude",
        time_dim: str = "time",
        history: int = 1,
        forecast: int = 1,
        static_variables: Sequence[str] = (),
        time_slice: slice | None = None,
        uneven: bool = True,
        dtype: Any = None,
        open_kwargs: dict | None = None,
    ) -> None:
        manager = resolve_manager(manager)
        comm, _, _ = domain_layout(manager)
        (rows, cols), (row, col) = grid_position(manager)
        open_kwargs = dict(open_kwargs or {})
        opened: dict[str, Any] = {}

        def plan() -> dict:
            names = _names("variables", variables, allow_empty=False)
            statics = _names("static_variables", static_variables, allow_empty=True)
            h = check_int("history", history, minimum=1)
            f = check_int("forecast", forecast, minimum=0)
            if not isinstance(uneven, bool):
                raise TypeError(f"uneven must be True or False, got {uneven!r}")
            if time_slice is not None and not isinstance(time_slice, slice):
                raise TypeError(f"time_slice must be a slice or None, got {time_slice!r}")
            ds = opened["ds"] = open_store(store, open_kwargs)
            what = f"the store {store_name(store)[-1]!r}"
            check_dim(ds, dim, what)
            check_dim(ds, time_dim, what)
            check_complete(ds, what)
            layout = [_layout(ds, name, dim, time_dim, True) for name in names]
            static_layout = [_layout(ds, name, dim, time_dim, False) for name in statics]
            widths = {ds.sizes[order[-1]] for _, order in layout + static_layout}
            if len(widths) != 1:
                raise ValueError(f"the variables' last dimensions differ in size ({sorted(widths)}); they must share one grid")
            positions = _positions(ds, time_dim, time_slice)
            count = len(positions) - h - f + 1
            if count < 1:
                raise ValueError(
                    f"time_slice={time_slice!r} selects {len(positions)} time(s) of {time_dim!r}; a sample needs "
                    f"history + forecast = {h + f}"
                )
            out_dtype = np.dtype(dtype) if dtype is not None else np.result_type(*(ds[v].dtype for v in names + statics))
            opened["plan"] = (layout, static_layout, positions, out_dtype, h, f)
            return {
                "store": store_name(store),
                "arguments": (tuple(names), tuple(statics), dim, time_dim, h, f, uneven, str(out_dtype)),
                "time": (len(positions), values_digest(positions)),
                **describe(ds),
            }

        agree(comm, "BandDataset", plan, lambda: close_quietly(opened.get("ds"), store))
        layout, static_layout, positions, out_dtype, h, f = opened["plan"]
        ds = opened["ds"]
        self.store = store
        self.variables = [name for name, _ in layout]
        self.static_variables = [name for name, _ in static_layout]
        self.dim, self.time_dim, self.history, self.forecast = dim, time_dim, h, f
        self.dtype = out_dtype
        self.open_kwargs = open_kwargs
        self.band = band_range(ds.sizes[dim], rows, row, uneven)
        width = ds.sizes[layout[0][1][-1]]
        self.lon_band = band_range(width, cols, col, uneven) if cols > 1 else None  # the last dim's block on a grid
        self.channels = sum(int(np.prod([ds.sizes[d] for d in order[1:-2]])) for _, order in layout)
        self._layout, self._static_layout = layout, static_layout
        self._positions = positions
        self._manager = manager
        self._ds: xr.Dataset | None = ds if ds is not store else store
        self._static: torch.Tensor | None = None

    # -- the Dataset protocol (no MPI below) ------------------------------

    def __len__(self) -> int:
        return len(self._positions) - self.history - self.forecast + 1

    def __getitem__(self, index: int) -> dict:
        length = len(self)
        i = int(index)
        if i < 0:
            i += length
        if not 0 <= i < length:
            raise IndexError(f"sample {index} is out of range for {length} samples")
        ds = self._open()
        times = self._positions[i : i + self.history + self.forecast]
        band = slice(*self.band)
        parts = []
        for name, order in self._layout:
            a = ds[name].isel({self.time_dim: _as_slice(times), self.dim: band, **self._lon_cut(order)}).transpose(*order).values
            parts.append(a.reshape(a.shape[0], -1, *a.shape[-2:]))
        data = np.concatenate(parts, axis=1).astype(self.dtype, copy=False).swapaxes(0, 1)  # (C, T, H, W)
        sample = {"x": torch.from_numpy(np.ascontiguousarray(data[:, : self.history]))}
        if self.forecast:
            sample["y"] = torch.from_numpy(np.ascontiguousarray(data[:, self.history :]))
        if self._static_layout:
            sample["static"] = self._static_band(ds)
        sample["index"] = i
        return sample

    def _static_band(self, ds: xr.Dataset) -> torch.Tensor:
        if self._static is None:
            parts = []
            for name, order in self._static_layout:
                a = ds[name].isel({self.dim: slice(*self.band), **self._lon_cut(order)}).transpose(*order).values
                parts.append(a.reshape(-1, 1, *a.shape[-2:]))
            self._static = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts).astype(self.dtype, copy=False)))
        return self._static.clone()

    def _lon_cut(self, order: tuple) -> dict:
        """The last dim's block of a variable laid out as ``order`` on a grid (nothing on bands)."""
        return {} if self.lon_band is None else {order[-1]: slice(*self.lon_band)}

    def _open(self) -> xr.Dataset:
        if self._ds is None:
            self._ds = open_store(self.store, self.open_kwargs)
        return self._ds

    def close(self) -> None:
        """Close the store if this dataset opened it (it reopens on the next read)."""
        close_quietly(self._ds, self.store)
        self._ds = None

    # -- data parallelism ---------------------------------------------------

    def sampler(self, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> torch.utils.data.Sampler:
        """A sampler that gives each data-parallel replica different samples, and every band of one replica the same.

        A ``torch.utils.data.DistributedSampler`` over the data-parallel group
        (``num_replicas=manager.dp_world_size``, ``rank=manager.dp_rank``).
        Collective over the manager's whole communicator: every rank must pass
        the same ``shuffle``, ``seed`` and ``drop_last`` and have the same
        number of samples (else the same ValueError everywhere). Call
        ``set_epoch(epoch)`` on it every epoch, on every rank.
        """
        manager = self._manager
        replicas, rank = (1, 0) if manager is None else (manager.dp_world_size, manager.dp_rank)

        def plan() -> dict:
            if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
                raise TypeError(f"shuffle and drop_last must be True or False, got {shuffle!r}, {drop_last!r}")
            return {"shuffle": shuffle, "seed": check_int("seed", seed), "drop_last": drop_last, "samples": len(self)}

        if manager is None:
            plan()
        else:
            agree(manager.comm, "BandDataset.sampler", plan, lambda: None)
        return torch.utils.data.DistributedSampler(
            self, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )

    # -- pickling for DataLoader workers --------------------------------------

    def __reduce__(self) -> tuple:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_manager", "_ds", "_static")}
        if isinstance(self.store, xr.Dataset):
            state["_ds"] = self.store
        return (_REBUILD, (state,))


def _rebuild(state: dict) -> BandDataset:
    dataset = BandDataset.__new__(BandDataset)
    dataset.__dict__.update(state)
    dataset.__dict__.setdefault("_ds", None)
    dataset._manager = None
    dataset._static = None
    return dataset


class _Call:
    """Pickles as the call ``func(*args)``, evaluated (in argument order) when unpickled."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __call__(self, *args: Any) -> Any:  # pickle requires a callable in a reduce tuple
        raise TypeError("a pickling placeholder, not meant to be called")

    def __reduce__(self) -> tuple:
        return (self.func, self.args)


# What a pickled BandDataset calls to come back. Unpickling a credit_mpi class
# imports credit_mpi, which imports mpi4py.MPI, which initialises MPI: in a
# DataLoader worker started with spawn/forkserver under an MPI launcher that
# kills the worker (the launcher's PMI connection belongs to the rank). So the
# pickle first sets mpi4py.rc.initialize = False (mpi4py then loads MPI without
# initialising it; read only when mpi4py.MPI is first imported, so harmless
# in a process that has MPI already), then imports this module: only
# builtins and importlib are named before that.
_REBUILD = _Call(
    getattr,
    _Call(
        importlib.import_module,
        __name__,
        _Call(setattr, _Call(getattr, _Call(importlib.import_module, "mpi4py"), "rc"), "initialize", False),
    ),
    "_rebuild",
)


def _names(what: str, names: Any, *, allow_empty: bool) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(v, str) for v in names):
        raise TypeError(f"{what} must be a list of variable names, got {names!r}")
    if not names and not allow_empty:
        raise ValueError(f"{what} must name at least one variable")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names a variable twice: {list(names)}")
    return list(names)


def _layout(ds: xr.Dataset, name: str, dim: str, time_dim: str, timed: bool) -> tuple[str, tuple]:
    """``(name, dims order)``: (time, *channel dims, dim, last) or, static, (*channel dims, dim, last)."""
    if name not in ds.data_vars:
        raise ValueError(f"variable {name!r} is not in the store; its data variables are {sorted(map(str, ds.data_vars))}")
    dims = tuple(ds[name].dims)
    if dim not in dims:
        raise ValueError(f"variable {name!r} has no {dim!r} dimension (dims {dims})")
    if timed != (time_dim in dims):
        need = "needs" if timed else "must not have"
        raise ValueError(f"variable {name!r} {need} the {time_dim!r} dimension (dims {dims}); pass it as "
                         f"{'static_variables' if timed else 'variables'}")
    rest = [d for d in dims if d not in (dim, time_dim)]
    if not rest:
        raise ValueError(f"variable {name!r} has no dimension besides {dim!r} and {time_dim!r} (dims {dims})")
    order = (*rest[:-1], dim, rest[-1])
    return str(name), ((time_dim,) + order if timed else order)


def _positions(ds: xr.Dataset, time_dim: str, time_slice: slice | None) -> np.ndarray:
    positions = np.arange(ds.sizes[time_dim])
    if time_slice is None:
        return positions
    labels = (time_slice.start, time_slice.stop)
    if all(v is None or isinstance(v, (int, np.integer)) for v in labels):
        return positions[time_slice]
    if time_dim not in ds.indexes:
        raise ValueError(f"time_slice {time_slice!r} uses labels but {time_dim!r} has no coordinate")
    return positions[ds.indexes[time_dim].slice_indexer(time_slice.start, time_slice.stop, time_slice.step)]


def _as_slice(positions: np.ndarray) -> Any:
    """A slice when the positions are evenly spaced (zarr reads slices fastest), else the positions."""
    if len(positions) == 1:
        return slice(int(positions[0]), int(positions[0]) + 1)
    step = int(positions[1] - positions[0])
    if step > 0 and np.all(np.diff(positions) == step):
        return slice(int(positions[0]), int(positions[-1]) + 1, step)
    return positions
