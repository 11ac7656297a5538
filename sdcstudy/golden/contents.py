"""A golden record read once and checked against itself before anything runs.

`open_record` reads the manifest (against `--expect-sha` when given), then config.yaml,
env.json and golden.json, each once, bounded and checked against the manifest (golden/
manifest.py), and checks that they describe one workload: golden.json's steps and microsteps
are the config's, its parameters add up to the config's model, its sites lie in the model's
layers, the full workload's config is the one its sizes make, and which steps keep full
parameter values follows the record's own rule. From these it knows every array golden.npz
must hold, with its dtype and shape. Only then is golden.npz read: its size within what those
arrays take, no member missing or extra, each member's declared dtype and shape the expected
ones before its data is decompressed. So a record that lies about its size costs at most the
bytes its config implies, and it is decompressed once per command, whatever the number of
devices checked against it. Imports no JAX.

This finds a damaged or inconsistent record; it cannot tell a record resealed by someone who
can write the folder from a true one. `--expect-sha` does that.
"""

from __future__ import annotations

import dataclasses
import io
import re
import zipfile
from pathlib import Path

import numpy as np

from sdcstudy.core import config as C
from sdcstudy.core.config import Config, UserError
from sdcstudy.golden import manifest as M
from sdcstudy.golden.manifest import ARRAYS, ENV, FORMAT, META, GoldenError
from sdcstudy.golden.sizing import BLOCKS, COVERAGE_DIGESTS, FullSizing, n_blocks

FULL_PARAMS_BUDGET = 3 * 2**20  # bytes of full parameter values kept for all steps
LAST_PARAMS_BUDGET = 64 * 2**20  # ... else of the last step, up to this many bytes
MAX_SITE_NAMES = 32  # site names per layer (the model has 15)
NPY_HEADER_BYTES = 1 << 16  # the most a .npy member's header may take
PARAM_BITS = {"float32": "uint32", "bfloat16": "uint16"}  # full parameter values, as bits
_SITE_KEY = re.compile(r"([a-z_]{1,64})/(\d{1,6})")


@dataclasses.dataclass(frozen=True)
class Golden:
    """A golden record, read and checked (`open_record`)."""

    dir: Path
    manifest_sha256: str
    cfg: Config
    env: dict
    meta: dict
    arrays: dict  # name -> read-only numpy array


def open_record(golden_dir: Path, expect_sha: str | None = None) -> Golden:
    """The record in `golden_dir`, read once and checked (module docstring); GoldenError with
    one sentence when it is not a usable golden record."""
    golden_dir = Path(golden_dir)
    manifest = M.read_manifest(golden_dir, expect_sha)
    cfg = M.config_from_bytes(M.read_file(golden_dir, manifest, M.CONFIG), golden_dir)
    try:
        check_config(cfg)
    except UserError as e:
        raise GoldenError(f"the golden config is not a golden workload: {e}") from None
    env = M.json_object(M.read_file(golden_dir, manifest, ENV), ENV, golden_dir)
    if not isinstance(env.get("platform"), str):
        raise GoldenError(f"golden file {ENV} in {str(golden_dir)!r} names no platform; record "
                          f"the golden run again.")
    meta = M.json_object(M.read_file(golden_dir, manifest, META), META, golden_dir)
    layout = expected_arrays(cfg, meta, golden_dir)
    data = M.read_file(golden_dir, manifest, ARRAYS, limit=npz_limit(layout))
    arrays = read_arrays(data, layout, golden_dir)
    return Golden(golden_dir, M.body_sha256(manifest["body"]), cfg, env, meta, arrays)


def check_config(cfg: Config) -> None:
    """What a golden workload is: a training on one device, with no faults."""
    e = cfg.experiment
    if e.mode != "train":
        raise UserError(f"a golden run trains one node: experiment.mode must be 'train', "
                        f"not {e.mode!r}.")
    if cfg.mesh.tp != 1 or cfg.mesh.dp != 1:
        raise UserError("a golden run uses one device: mesh.tp and mesh.dp must be 1 (check "
                        "each device with --device I).")
    if cfg.suspect.profile != "healthy":
        raise UserError("a golden record is a clean run: suspect.profile must be 'healthy' "
                        "(inject faults at check time with --inject).")


def full_param_steps(param_bytes: int, steps: int) -> list[int]:
    """The steps whose full parameter values a record keeps: every step while they fit in
    FULL_PARAMS_BUDGET bytes, else the last while it fits in LAST_PARAMS_BUDGET, else none."""
    if param_bytes * steps <= FULL_PARAMS_BUDGET:
        return list(range(1, steps + 1))
    return [steps] if param_bytes <= LAST_PARAMS_BUDGET else []


# --- golden.json against the config ------------------------------------------------------------


def _bad(golden_dir: Path, what: str) -> GoldenError:
    return GoldenError(f"golden file {META} in {str(golden_dir)!r} is not consistent with its "
                       f"config ({what}); record the golden run again.")


def _field(meta: dict, key: str, kind, golden_dir: Path):
    value = meta.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _bad(golden_dir, f"{key} is {type(value).__name__}")
    return value


def _shape(entry, golden_dir: Path, what: str) -> tuple[int, ...]:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(type(n) is int and 1 <= n <= 2**40 for n in shape)):
        raise _bad(golden_dir, f"{what} has no valid shape")
    return tuple(shape)


def expected_arrays(cfg: Config, meta: dict, golden_dir: Path) -> dict[str, tuple[str, tuple]]:
    """Every array golden.npz must hold, name -> (dtype, shape), from the config and golden.json
    once they agree with each other (GoldenError naming the first disagreement)."""
    e, dims = cfg.experiment, C.model_dims(cfg.model)
    if meta.get("format") != FORMAT or meta.get("blocks") != BLOCKS:
        raise _bad(golden_dir, f"format {meta.get('format')!r}, {meta.get('blocks')!r} digest "
                               f"blocks")
    steps, micro = _field(meta, "steps", int, golden_dir), _field(meta, "microsteps", int,
                                                                   golden_dir)
    if (steps, micro) != (e.steps, e.microsteps):
        raise _bad(golden_dir, f"{steps} steps of {micro} microsteps, the config says "
                               f"{e.steps} of {e.microsteps}")
    _check_workload(cfg, meta, golden_dir)
    layout = {"tokens": ("int32", (steps, micro, e.batch_size, cfg.data.seq_len + 1)),
              "loss": ("uint32", (steps,)), "grad_norm": ("uint32", (steps,))}
    for key, shape in _sites(meta, dims.n_layers, golden_dir).items():
        for direction in ("fwd", "bwd"):
            layout[f"{direction}/{key}"] = ("uint32", (steps, micro, n_blocks(_size(shape)), 2))
    params = _params(meta, dims, golden_dir)
    for path, shape in params.items():
        layout[f"params/{path}"] = ("uint32", (steps + 1, n_blocks(_size(shape)), 2))
    bits = PARAM_BITS[dims.param_dtype]
    param_bytes = sum(_size(s) for s in params.values()) * np.dtype(bits).itemsize
    if meta.get("full_param_steps") != full_param_steps(param_bytes, steps):
        raise _bad(golden_dir, f"full parameter values at steps {meta.get('full_param_steps')!r}, "
                               f"a record of {param_bytes} bytes of parameters keeps "
                               f"{full_param_steps(param_bytes, steps)}")
    for step in full_param_steps(param_bytes, steps):
        for path, shape in params.items():
            layout[f"full/{step}/{path}"] = (bits, shape)
    if meta.get("sizing"):
        sizing = FullSizing(**meta["sizing"])
        layout["coverage/memory"] = ("uint32", (steps, sizing.buffer_chunks, 2))
        for name in COVERAGE_DIGESTS[1:]:
            layout[f"coverage/{name}"] = ("uint32", (steps, n_blocks(sizing.gemm_size ** 2), 2))
    return layout


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=object))


def _check_workload(cfg: Config, meta: dict, golden_dir: Path) -> None:
    """tiny: no sizes and no coverage digests; full: the config its sizes make."""
    workload, sizing = meta.get("workload", "tiny"), meta.get("sizing")
    if workload == "tiny" and sizing is None and meta.get("coverage_digests", []) == []:
        return
    if workload != "full" or not isinstance(sizing, dict):
        raise _bad(golden_dir, f"workload {workload!r} with sizes {type(sizing).__name__}")
    numbers = {k: v for k, v in sizing.items() if k not in ("dtype", "min_seconds")}
    if not all(type(v) is int and 1 <= v <= 2**31 for v in numbers.values()):
        raise _bad(golden_dir, "the full workload's sizes are not whole numbers")
    try:
        made = C.dump(C.from_dict(FullSizing(**sizing).config()))
    except (TypeError, ValueError, UserError):
        raise _bad(golden_dir, "the full workload's sizes are not valid") from None
    if made != C.dump(cfg) or meta.get("coverage_digests") != list(COVERAGE_DIGESTS):
        raise _bad(golden_dir, "the full workload's config or digests differ from what its "
                               "sizes make")


def _sites(meta: dict, n_layers: int, golden_dir: Path) -> dict[str, tuple]:
    """The sites, each in a layer of the model (0: outside the blocks), named once."""
    order, sites = _field(meta, "site_order", list, golden_dir), _field(meta, "sites", dict,
                                                                        golden_dir)
    names = set()
    for key in order:
        match = _SITE_KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None or int(match.group(2)) > n_layers:
            raise _bad(golden_dir, f"site {key!r} is not a site of a {n_layers}-layer model")
        names.add(match.group(1))
    if len(set(order)) != len(order) or set(order) != set(sites) or len(names) > MAX_SITE_NAMES:
        raise _bad(golden_dir, "the sites are not each named once")
    return {key: _shape(sites[key], golden_dir, f"site {key}") for key in order}


def _params(meta: dict, dims, golden_dir: Path) -> dict[str, tuple]:
    """The parameter tensors: the config's model's number of parameters, in its dtype."""
    params = _field(meta, "params", dict, golden_dir)
    shapes = {}
    for path, entry in params.items():
        shapes[path] = _shape(entry, golden_dir, f"parameter {path}")
        if entry.get("dtype") != dims.param_dtype:
            raise _bad(golden_dir, f"parameter {path} is {entry.get('dtype')!r}, the config's "
                                   f"parameters are {dims.param_dtype}")
    count = sum(_size(s) for s in shapes.values())
    if count != dims.n_params:
        raise _bad(golden_dir, f"{count} parameters, the config's model has {dims.n_params}")
    final = meta.get("final_param_sha256")
    if not isinstance(final, dict) or set(final) != set(shapes):
        raise _bad(golden_dir, "the final parameters' SHA-256 do not name every tensor")
    state = meta.get("final_state_sha256")  # absent from older records
    if "final_state_sha256" in meta and (not isinstance(state, dict) or not state or not all(
            isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in state.values())):
        raise _bad(golden_dir, "the final optimizer state's SHA-256 are not SHA-256 digests")
    return shapes


# --- golden.npz -------------------------------------------------------------------------------


def _nbytes(dtype: str, shape: tuple) -> int:
    return np.dtype(dtype).itemsize * _size(shape)


def npz_limit(layout: dict) -> int:
    """The most golden.npz may take on disk for `layout`: its arrays uncompressed, plus the
    zip's and the .npy headers' overhead."""
    data = sum(_nbytes(dtype, shape) for dtype, shape in layout.values())
    return data + data // 64 + len(layout) * (1024 + 2 * max(map(len, layout))) + (1 << 16)


def read_arrays(data: bytes, layout: dict, golden_dir: Path) -> dict[str, np.ndarray]:
    """golden.npz's arrays, each checked against `layout` (dtype, shape) before its data is
    decompressed; read-only (one copy serves every device of a command)."""
    where = f"golden file {ARRAYS} in {str(golden_dir)!r}"
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as npz:
            members = npz.infolist()
            names = [m.filename.removesuffix(".npy") for m in members]
            if len(set(names)) != len(names) or set(names) != set(layout):
                missing, extra = sorted(set(layout) - set(names)), sorted(set(names) - set(layout))
                raise GoldenError(f"{where} does not hold the arrays its config implies ("
                                  f"{len(missing)} missing, first {missing[:1]}; {len(extra)} "
                                  f"not expected, first {extra[:1]}); record the golden run "
                                  f"again.")
            return {name: _read_member(npz, member, *layout[name], where)
                    for name, member in zip(names, members)}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, RuntimeError,
            NotImplementedError) as e:
        raise GoldenError(f"{where} cannot be read ({e}); record the golden run again.") from None


def _read_member(npz: zipfile.ZipFile, member: zipfile.ZipInfo, dtype: str, shape: tuple,
                 where: str) -> np.ndarray:
    nbytes = _nbytes(dtype, shape)
    name = member.filename.removesuffix(".npy")
    if member.file_size > nbytes + NPY_HEADER_BYTES:
        raise GoldenError(f"{where}: array {name} declares {member.file_size} bytes, its config "
                          f"implies {nbytes}; record the golden run again.")
    with npz.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise GoldenError(f"{where}: array {name} is .npy version {version}, not one that "
                              f"golden record writes; record the golden run again.")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        found_shape, fortran, found_dtype = read_header(f, max_header_size=NPY_HEADER_BYTES)
        if found_dtype != np.dtype(dtype) or tuple(found_shape) != shape:
            raise GoldenError(f"{where}: array {name} is {found_dtype} {tuple(found_shape)}, "
                              f"its config implies {dtype} {shape}; record the golden run "
                              f"again.")
        raw = f.read(nbytes)
    if len(raw) != nbytes:
        raise GoldenError(f"{where}: array {name} is cut short; record the golden run again.")
    array = np.frombuffer(raw, np.dtype(dtype)).reshape(shape, order="F" if fortran else "C")
    array.flags.writeable = False
    return array
