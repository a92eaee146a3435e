"""Step tables on disk: `<dir>/<gpu>--<org>--<name>--tp<tp>--aic<version>--v<grid>.npz`.

`load_or_build` loads the file when it is there; when it is not, it takes an exclusive lock on
`<file>.lock`, looks again (another process may have built it meanwhile), builds, writes to a
temporary file in the same folder and renames it over the name, so that many replicas starting at
once build one table between them and never read a half-written one. Loading imports numpy only:
AIConfigurator's version comes from the installed package's metadata, not from importing it.
A folder that cannot be written, or a file that does not load, falls back to building in memory.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable
from importlib import metadata

import numpy as np

from baton.engine.simulated.config import AIC_PACKAGE
from baton.engine.simulated.step_table import ARRAYS, AXES, StepTable, TableKey
from baton.engine.simulated.step_table_build import GRID_VERSION, build_table  # imports aiconfigurator_core only when it builds

log = logging.getLogger(__name__)

Builder = Callable[[TableKey], StepTable]


def table_dir(cache_root: str) -> str:
    """Where the step tables of a checkout whose cache is `cache_root` (its .cache) live."""
    return os.path.join(cache_root, "baton", "step-tables")


def table_key(gpu: str, model: str, tp: int) -> TableKey:
    return TableKey(gpu, model, tp, metadata.version(AIC_PACKAGE), GRID_VERSION)


def save_table(table: StepTable, path: str) -> None:
    """Write atomically: a temporary file beside `path`, renamed over it."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".step-table-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            meta = {"key": table.key.__dict__, "build_seconds": table.build_seconds}
            np.savez(f, meta=np.array(json.dumps(meta)), **{f"axis_{n}": table.axes[n] for n in AXES}, **table.arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_table(path: str, key: TableKey) -> StepTable:
    """Raises ValueError when the file holds another key's table or fails StepTable's integrity check."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        if TableKey(**meta["key"]) != key:
            raise ValueError(f"{path} holds {meta['key']}, not {key}")
        return StepTable(key, {n: z[f"axis_{n}"] for n in AXES}, {n: z[n] for n in ARRAYS}, float(meta["build_seconds"]))


def load_or_build(folder: str, gpu: str, model: str, tp: int, build: Builder | None = None) -> StepTable:
    """The cached table of gpu + model + tp, built (once across processes) when missing. `build`:
    step_table_build.build_table unless a test passes its own."""
    key = table_key(gpu, model, tp)
    path = os.path.join(folder, key.filename)
    if os.path.exists(path):
        table = _try_load(path, key)
        if table is not None:
            return table
    build = build or build_table
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(path + ".lock", "a")  # held (and flocked) until the table is on disk
    except OSError as e:
        log.warning("step table folder %s is not writable (%s): building %s in memory", folder, e, key.filename)
        return build(key)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        table = _try_load(path, key) if os.path.exists(path) else None
        if table is None:
            table = build(key)
            save_table(table, path)
            log.info("built step table %s in %.1f s", path, table.build_seconds)
        return table


def _try_load(path: str, key: TableKey) -> StepTable | None:
    try:
        return load_table(path, key)
    except (OSError, ValueError, KeyError) as e:
        log.warning("step table %s does not load (%s): rebuilding it", path, e)
        return None

