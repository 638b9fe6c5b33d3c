"""examples/train_unet.py: its store (``--store``), resume (``--resume``), FSDP2, bf16 and its command line.

MPI tests: the example's ``main()`` runs on the current communicator (1-4
ranks; on 4 ranks as 2 bands x 2 data-parallel groups). It writes the
synthetic field as a Zarr store (``--make-store``: write_bands from
data-parallel group 0), reads it back through BandDataset + DataLoader with
the data-parallel sampler, and returns 0 only when its loss curve equals the
single-process run on the whole store (relative 1e-9). The batches are
smaller than each replica's share of the samples, so the curve depends on
the sampler's order: a reference that trained on other global batches would
differ from step 0. A run resumed from a checkpoint gives the uninterrupted
run's losses exactly; ``--fsdp`` and ``--bf16`` train against one process;
``--help`` shows the defaults and a ``--data-parallel`` that does not divide
the ranks is refused.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from .conftest import load_example

pytest.importorskip("xarray")
pytest.importorskip("zarr")


def example():
    return load_example("train_unet")



def layout(size: int) -> list[str]:
    """2 bands x 2 groups on 4 ranks; 24 latitudes on 3 ranks (band offsets even: no re-band at the skip's join;
    the defaults' test and test_example_bf16_rebands re-band)."""
    dp = 2 if size == 4 else 1
    lat = 24 if size == 3 else 16
    return ["--data-parallel", str(dp), "--lat", str(lat), "--lon", "16"]


@pytest.mark.mpi(min_size=1)
def test_example_runs_at_its_defaults(capsys):
    """No layout option at all (--lat 32 on 3 ranks: bands 11/11/10, a join of bands of two layouts), a few steps."""
    assert example().main(["--steps", "2"]) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "loss curves equal (data from memory)" in capsys.readouterr().out


@pytest.mark.mpi(min_size=1)
def test_example_reads_its_store_and_matches_one_process(shared_dir, capsys):
    world = MPI.COMM_WORLD
    module = example()
    store = os.path.join(shared_dir, "era5.zarr")
    args = [*layout(world.Get_size()), "--steps", "2", "--samples", "3", "--batch", "2", "--store", store]
    assert module.main([*args, "--make-store"]) == 0
    if world.Get_rank() == 0:
        assert "loss curves equal (data from store" in capsys.readouterr().out
    # the store holds the synthetic trajectory, whoever wrote which band
    import xarray as xr

    dp, lat = int(args[1]), int(args[3])
    expected = module.era5_like(3 * dp, lat, 16, seed=1).numpy()
    with xr.open_zarr(store) as ds:
        assert ds["t"].dims == ("time", "latitude", "longitude")
        np.testing.assert_array_equal(ds["t"].values, expected[:, 0])
        np.testing.assert_array_equal(ds["u"].values, expected[:, 1])
        np.testing.assert_array_equal(ds["latitude"].values, np.linspace(90.0, -90.0, lat))
    world.Barrier()
    # an existing store is read as it is (no --make-store), with clipping of the global gradient norm
    assert module.main([*args, "--steps", "3", "--clip", "0.05"]) == 0


@pytest.mark.mpi(min_size=1)
def test_example_missing_store_is_one_error_everywhere(shared_dir):
    module = example()
    missing = os.path.join(shared_dir, "nothing.zarr")
    with pytest.raises(ValueError, match="does not exist"):
        module.main([*layout(MPI.COMM_WORLD.Get_size()), "--steps", "1", "--store", missing])


def test_example_make_store_needs_a_path(capsys):
    with pytest.raises(SystemExit) as exc:
        example().main(["--make-store"])
    assert exc.value.code == 2
    assert "--make-store needs --store PATH" in capsys.readouterr().err


@pytest.mark.mpi(min_size=1)
def test_example_refuses_a_layout_its_skip_connection_cannot_join():
    """15 latitudes (odd: the join cannot match, on any layout): one ValueError on every rank before the first step."""
    with pytest.raises(ValueError, match=r"--lat 15[ :].*the UNet needs an even latitude count"):
        example().main(["--data-parallel", "1", "--lat", "15", "--lon", "16", "--steps", "1"])


@pytest.mark.mpi(min_size=2)
def test_example_names_the_first_layer_a_thin_band_refuses():
    """2 (size - 1) latitudes on ``size`` bands: the last band of one row gets no row of the stride-2 conv."""
    size = MPI.COMM_WORLD.Get_size()
    lat = str(2 * size - 2)
    with pytest.raises(ValueError, match=rf"--lat {lat} on {size} band\(s\): layer down.0 \(Conv2d\).*at least {2 * size}"):
        example().main(["--data-parallel", "1", "--lat", lat, "--lon", "16", "--steps", "1"])


def test_example_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        example().main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 20)" in out and "(default: unet_checkpoint.pt)" in out


def test_example_refuses_a_data_parallel_size_that_does_not_divide_the_ranks(capsys):
    """``-n 3 --data-parallel 2`` ran 1 band x 3 replicas (integer division); on one rank: --data-parallel 2."""
    size = MPI.COMM_WORLD.Get_size()
    with pytest.raises(SystemExit) as exc:
        example().main(["--data-parallel", str(size + 1)])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--data-parallel {size + 1} does not divide the {size} rank(s)" in err


def curve(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.mpi(min_size=1)
def test_example_resumes_bit_for_bit(shared_dir):
    """4 steps straight; 2 steps with a checkpoint, then --resume to 4: the same losses (float equality)."""
    world = MPI.COMM_WORLD
    module = example()
    base = [*layout(world.Get_size()), "--checkpoint", os.path.join(shared_dir, "ckpt.pt")]
    straight, resumed = os.path.join(shared_dir, "straight.json"), os.path.join(shared_dir, "resumed.json")
    assert module.main([*base, "--steps", "4", "--log", straight]) == 0
    assert module.main([*base, "--steps", "2", "--checkpoint-every", "2"]) == 0
    assert module.main([*base, "--steps", "4", "--resume", "--log", resumed]) == 0
    if world.Get_rank() == 0:
        a, b = curve(straight), curve(resumed)
        assert b["steps"] == [2, 3]
        assert b["loss"] == a["loss"][2:]


@pytest.mark.mpi(min_size=2)
def test_example_trains_with_fsdp_and_bf16(shared_dir):
    """--fsdp (exact against one process) and --bf16 (within bf16 tolerance), with a checkpoint of the FSDP model."""
    module = example()
    args = [*layout(MPI.COMM_WORLD.Get_size()), "--steps", "2", "--checkpoint", os.path.join(shared_dir, "f.pt")]
    assert module.main([*args, "--fsdp", "--checkpoint-every", "1"]) == 0
    assert module.main([*args, "--fsdp", "--steps", "3", "--resume"]) == 0
    assert module.main([*args, "--bf16"]) == 0


@pytest.mark.mpi(min_size=3)
@pytest.mark.world_sizes(3)
def test_example_bf16_rebands():
    """16 latitudes on 3 ranks (6, 5, 5): the skip's join re-bands bf16 bands (it used to refuse all but
    float32/float64), within bf16's tolerance of one process."""
    assert example().main(["--lat", "16", "--lon", "16", "--bf16", "--steps", "2"]) == 0
