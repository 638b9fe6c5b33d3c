"""CREDIT's own gen-2 trainer on a tiny synthetic ERA5-like dataset (tests/test_credit_trainer.py).

Launched by the test, not collected by pytest::

    python tests/credit_trainer_job.py write DIR [--domain D] [--data none|fsdp2|ddp] [--batch B]
    mpiexec -n N python tests/credit_trainer_job.py train DIR/config.yml LOSSES.json

``write`` makes the dataset (CREDIT's LocalDataset format: a yearly NetCDF file of prognostic
fields on a 64 x 64 latitude x longitude grid, a static field) and a gen-2 config (a small WXFormer,
two forecast steps, two batches). ``train`` runs ``credit-mpi credit train`` (CREDIT's trainer, its
code unchanged) and rank 0 writes every loss CREDIT's trainer logged, in order, at full precision
(the trainer's ``accum_log`` is watched: it only prints running means to 6 decimals), averaged over
the ranks as CREDIT's trainer averages them for its report (each rank's loss is its band's mean,
equal bands: the mean of the band means is the field's mean).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HEIGHT = WIDTH = 64
LEVELS = [500, 850]
TIMES = 12  # 6-hourly: enough for two batches of two samples of two forecast steps


def smooth_fields(rng: np.random.Generator, count: int) -> np.ndarray:
    """``(TIMES, count, HEIGHT, WIDTH)`` float32: a few waves that drift east, plus a little noise."""
    lat = np.linspace(-np.pi / 2, np.pi / 2, HEIGHT)[:, None]
    lon = np.linspace(0, 2 * np.pi, WIDTH, endpoint=False)[None, :]
    out = np.empty((TIMES, count, HEIGHT, WIDTH), np.float32)
    for c in range(count):
        k, m, phase = rng.integers(1, 4), rng.integers(1, 4), rng.uniform(0, 2 * np.pi)
        for t in range(TIMES):
            wave = np.cos(k * lat) * np.sin(m * lon - 0.3 * t + phase)
            out[t, c] = wave + 0.1 * rng.standard_normal((HEIGHT, WIDTH))
    return out


def write_dataset(root: Path) -> None:
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(0)
    times = pd.date_range("2020-01-01", periods=TIMES, freq="6h")
    coords = {"latitude": np.linspace(87.1875, -87.1875, HEIGHT), "longitude": np.linspace(0, 360, WIDTH, endpoint=False)}
    level = smooth_fields(rng, 2 * len(LEVELS)).reshape(TIMES, 2, len(LEVELS), HEIGHT, WIDTH)
    dims3, dims2 = ("time", "level", "latitude", "longitude"), ("time", "latitude", "longitude")
    xr.Dataset({"T": (dims3, level[:, 0]), "U": (dims3, level[:, 1]), "SP": (dims2, smooth_fields(rng, 1)[:, 0])},
               coords={"time": times, "level": LEVELS, **coords}).to_netcdf(root / "era5_2020.nc")
    xr.Dataset({"LSM": (("latitude", "longitude"), smooth_fields(rng, 1)[0, 0])},
               coords=coords).to_netcdf(root / "static.nc")


def config(root: Path, domain: int = 1, data: str = "none", batch: int = 1) -> dict:
    """A gen-2 config: WXFormer 64 x 64, forecast_len 2, two batches, AdamW lr 1e-4, no validation."""
    source = {"dataset_type": "local", "grid_type": "rectilinear", "level_coord": "level", "levels": LEVELS,
              "variables": {"prognostic": {"vars_3D": ["T", "U"], "vars_2D": ["SP"], "path": str(root / "era5_*.nc"),
                                           "filename_time_format": "%Y"},
                            "static": {"vars_2D": ["LSM"], "path": str(root / "static.nc")},
                            "diagnostic": None, "dynamic_forcing": None}}
    return {
        "save_loc": str(root / "out"), "seed": 1000,
        "data": {"source": {"ERA5": source}, "start_datetime": "2020-01-01", "end_datetime": "2020-01-03",
                 "timestep": "6h", "history_len": 1, "forecast_len": 2},
        "preblocks": {"per_step": {"concat": {"type": "concat"}}},
        "postblocks": {"per_step": {
            "reconstruct": {"type": "reconstruct", "args": {"detach": False}},
            "reconstruct_target": {"type": "reconstruct", "args": {"in_key": "y", "out_key": "y_target_processed"}}}},
        "model": {"type": "wxformer", "frames": 1, "image_height": HEIGHT, "image_width": WIDTH, "levels": len(LEVELS),
                  "channels": 2, "surface_channels": 1, "input_only_channels": 1, "output_only_channels": 0,
                  "patch_height": 1, "patch_width": 1, "dim": [8, 16, 32, 64], "dim_head": 8, "depth": [1, 1, 1, 1],
                  "global_window_size": [4, 2, 2, 1], "local_window_size": 2,
                  "cross_embed_kernel_sizes": [[4, 8], [2, 4], [2, 4], [2, 4]], "cross_embed_strides": [2, 2, 2, 2],
                  "use_spectral_norm": False, "interp": False, "upsample_with_ps": True,
                  "padding_conf": {"activate": False}},
        "loss": {"training_loss": "mse", "validation_loss": "mse", "use_variable_weights": False,
                 "use_latitude_weights": False, "use_power_loss": False, "use_spectral_loss": False},
        "trainer": {"type": "gen2", "parallelism": {"data": data, "tensor": 1, "domain": domain},
                    "load_weights": False, "load_optimizer": False, "load_scaler": False, "load_scheduler": False,
                    "learning_rate": 1.0e-4, "weight_decay": 0, "train_batch_size": batch, "valid_batch_size": batch,
                    "batches_per_epoch": 2, "valid_batches_per_epoch": 1, "start_epoch": 0, "num_epoch": 1,
                    "epochs": 1, "use_scheduler": False, "thread_workers": 0, "valid_thread_workers": 0,
                    "amp": False, "skip_validation": True, "save_backup_weights": False, "save_best_weights": False},
    }


def write(root: Path, domain: int, data: str, batch: int) -> Path:
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    if not (root / "era5_2020.nc").exists():
        write_dataset(root)
    path = root / f"config_{data}_d{domain}_b{batch}.yml"
    conf = config(root, domain, data, batch)
    conf["save_loc"] = str(root / f"out_{data}_d{domain}_b{batch}")
    path.write_text(yaml.safe_dump(conf, sort_keys=False))
    return path


def train(config_path: str, losses_path: str) -> int:
    from mpi4py import MPI

    from credit_mpi.credit import main, stand_in_gen1_post_block

    stand_in_gen1_post_block()
    from credit.trainers import trainer_gen2

    losses = []
    logged = trainer_gen2.accum_log

    def watch(log, new_logs):
        if "loss" in new_logs:
            losses.append(float(new_logs["loss"]))
        return logged(log, new_logs)

    trainer_gen2.accum_log = watch
    status = main(["train", "-c", config_path])
    every_rank = MPI.COMM_WORLD.gather(losses, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:  # each rank's loss is its band's (and sample's): CREDIT reports their mean
        Path(losses_path).write_text(json.dumps(np.mean(np.array(every_rank, np.float64), axis=0).tolist()))
    return status


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write")
    w.add_argument("root", type=Path)
    w.add_argument("--domain", type=int, default=1)
    w.add_argument("--data", default="none")
    w.add_argument("--batch", type=int, default=1)
    t = sub.add_parser("train")
    t.add_argument("config")
    t.add_argument("losses")
    args = parser.parse_args(argv)
    if args.what == "write":
        print(write(args.root, args.domain, args.data, args.batch))
        return 0
    return train(args.config, args.losses)


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[1]))
    raise SystemExit(cli(sys.argv[1:]))
