"""Checks before sealing: everything a run spec names is verified before `serve` writes the data dir.

The first start binds the data dir to the spec for good (the store refuses any other one
afterwards), and every worker builds the same run from it. So a spec that cannot work
must be refused before anything is written, with one line naming the key:

- the codec (`diloco.codec`) exists and parses;
- the data source (`data.source`, `data.path`) is readable and of the declared shape
  (channels, at least one image per cluster), and clusters as the spec asks;
- every cell's model builds from the spec (arch, presets, sizes), so every mode the spec
  selects is implemented;
- `checkpoint.max_bytes` admits the largest cell's checkpoint (else no checkpoint could
  ever be stored);
- the per-cell sizing (memory, payload, compute share) can be computed from the data.

`check_spec` raises `UsageError`; it loads the dataset and builds each model on the meta
device once (both cached in the process, so the daemon's own start reuses them).

`check_data_dir` reads an existing data dir without writing to it: the coordinator key
must load, the SQLite store must open and read, and the spec it holds must be this one.
So a damaged or foreign data dir is refused before the daemon creates anything in it.
"""

from __future__ import annotations

from pathlib import Path

from bagel.protocol.clierrors import RuntimeFailure, UsageError
from bagel.protocol.runspec import RunSpec


def check_spec(spec: RunSpec) -> None:
    """Refuse (UsageError, one line) a spec that names something that cannot work."""
    from bagel.compression import get_codec, registered_kinds

    try:
        get_codec(spec.diloco.codec)
    except ValueError as e:
        raise UsageError(
            f"run spec diloco.codec = {spec.diloco.codec!r}: {e}; use one of {', '.join(registered_kinds())}"
        ) from None
    _check_data(spec)
    largest, largest_cell = _check_models(spec)
    if spec.checkpoint.max_bytes < largest:
        raise UsageError(
            f"run spec checkpoint.max_bytes = {spec.checkpoint.max_bytes}: no checkpoint of cell {largest_cell} "
            f"({largest} bytes at most) could ever be stored; set it to at least {largest}"
        )
    from bagel.coordinator import sizing

    try:
        sizing.cell_configs(spec, fallback=False)
    except Exception as e:  # noqa: BLE001  (any failure here is the spec's: report it as such)
        raise UsageError(
            f"run spec: cannot size the cells ({type(e).__name__}: {e}); check [model] and [data]"
        ) from None


def check_data_dir(spec: RunSpec, data_dir: Path) -> None:
    """Refuse an existing data dir whose key or store cannot be used, read-only (module docstring)."""
    import sqlite3

    from bagel.coordinator.daemon import KEY_FILE
    from bagel.coordinator.store import DB_NAME, SpecMismatchError, Store
    from bagel.protocol.identity import Identity, IdentityError, KeyFilePermissionError

    key = data_dir / KEY_FILE
    if key.exists():
        try:
            Identity.load(key)
        except KeyFilePermissionError as e:
            raise RuntimeFailure(str(e)) from None
        except IdentityError as e:
            raise RuntimeFailure(
                f"{e}; restore {key} from a backup (a new key changes the join string and orphans the run's workers)"
            ) from None
    if not (data_dir / DB_NAME).exists():
        return
    try:
        store = Store.open_readonly(data_dir)
        try:
            stored = store.spec()
            store.load(recent_commits=1)
        finally:
            store.close()
    except sqlite3.DatabaseError as e:
        raise RuntimeFailure(
            f"the store {data_dir / DB_NAME} is damaged ({e}): restore the data dir from a backup, "
            "or start the run again in an empty data dir"
        ) from None
    if stored is not None and (stored.spec_hash != spec.spec_hash or stored.run_id != spec.run.id):
        raise UsageError(
            str(
                SpecMismatchError(
                    f"the data dir {data_dir} belongs to run {stored.run_id!r} with spec hash "
                    f"{stored.spec_hash[:16]}..., but the given spec is run {spec.run.id!r} with hash "
                    f"{spec.spec_hash[:16]}...; a run spec is immutable once the run starts: use the original "
                    "spec file or a new --data-dir"
                )
            )
        )


def _check_data(spec: RunSpec) -> None:
    from bagel.models.data import DataError, load_dataset

    d = spec.data
    where = f"data.source = {d.source!r}" + (f", data.path = {d.path!r}" if d.path else "")
    try:
        ds = load_dataset(spec)
    except (DataError, OSError, ValueError) as e:
        raise UsageError(
            f"run spec {where}: {e}; point data.path at a readable folder of images or .npy arrays "
            "(README: bringing your own data)"
        ) from None
    except Exception as e:  # noqa: BLE001  (a loader's odd failure is still the data's)
        raise UsageError(f"run spec {where}: cannot load the data ({type(e).__name__}: {e})") from None
    x = ds.x_train
    if x.ndim != 4 or x.shape[1] != spec.model.channels or x.shape[-1] != spec.model.image_size:
        raise UsageError(
            f"run spec {where}: images of shape {tuple(x.shape[1:])}, the model wants "
            f"({spec.model.channels}, {spec.model.image_size}, {spec.model.image_size}) "
            "(model.channels, model.image_size)"
        )
    if spec.model.num_classes > 0 and ds.num_classes > spec.model.num_classes:
        raise UsageError(
            f"run spec {where}: labels go up to {ds.num_classes - 1}, model.num_classes = {spec.model.num_classes}; "
            f"set it to at least {ds.num_classes}"
        )
    import numpy as np

    counts = np.bincount(ds.manifest.train_labels, minlength=d.clusters)
    empty = [k for k, n in enumerate(counts) if n == 0]
    if empty:
        raise UsageError(
            f"run spec {where}: cluster(s) {empty} get no training images ({len(x)} in all); lower data.clusters"
        )


def _check_models(spec: RunSpec) -> tuple[int, str]:
    """Build each cell's model (meta device); the largest checkpoint bound and its cell."""
    from bagel.coordinator.sizing import checkpoint_bytes_bound
    from bagel.models.experts import cell_state_schema

    largest, largest_cell = 0, ""
    for cell in spec.cell_ids:
        try:
            cell_state_schema(spec, cell)
            bound = checkpoint_bytes_bound(spec, cell)
        except Exception as e:  # noqa: BLE001  (the spec selects something the models do not implement)
            raise UsageError(
                f"run spec: cell {cell}'s model cannot be built ({type(e).__name__}: {e}); check [model]"
            ) from None
        if bound > largest:
            largest, largest_cell = bound, cell
    return largest, largest_cell


__all__ = ["check_data_dir", "check_spec"]
