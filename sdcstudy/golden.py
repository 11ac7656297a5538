"""Golden-run pre-admission tests: record a short training on a trusted node, re-run it on a
candidate node, compare every bit, and say where the candidate first went wrong.

`golden record` runs a deterministic single-device training (`experiment.mode: train`, the
tiny model by default) and keeps, for every optimizer step k (counted from 1):
- the bit patterns of the loss and of the gradient norm (before clipping);
- a digest of every parameter tensor after the update of step k (step 0: initialisation);
- a digest of every named site's value (`fwd/<site>`) and of the gradient arriving at it
  (`bwd/<site>`), per microstep and layer (`sites.py` names them);
plus the input tokens (so a check needs no dataset), the full parameter values of every step
when they fit in `FULL_PARAMS_BUDGET` bytes (otherwise of the last step only), SHA-256 of
every final parameter tensor, the config, the environment fingerprint and a manifest.

Digests are computed on the device, inside the jitted step: fetching every activation and
every parameter to the host for SHA-256 would copy the whole model and all its activations
off the device at every step (32 GB a step for llama3-8b), while the digest reads each tensor
once where it lies and returns 2 x 64 words. A digest of a tensor of n elements with bits u_i
(float32 or bfloat16 read as unsigned integers) is, per block of ceil(n / 64) consecutive
elements and per lane,
    lane A = sum_i mix(u_i) * (2 i + 1),    lane B = sum_i mix(u_i ^ c) * (mix(i) | 1)
in uint32 wrap-around arithmetic, with `mix` an invertible integer hash and i the position in
the whole tensor. Integer addition modulo 2**32 is associative, so the digest is exact whatever
order XLA reduces in; the multipliers are odd, hence invertible modulo 2**32, so any change to
a single element always changes both lanes, and a change to several elements goes unseen with
probability about 2**-64. It is not a cryptographic hash: a hardware fault is not an adversary.
The final parameters also get SHA-256 on the host (the `param_digest` of run folders).
Gradients arriving at a site leave the step through a custom-VJP identity whose backward
digests the cotangent and returns the digest as the cotangent of a zero "sink" input (as
`lockstep.py` does), split into 16-bit halves so that float32 carries them exactly.

`golden check` verifies the manifest, compares the environment (a difference is INCONCLUSIVE
unless allowed), re-runs on one device and compares step by step in program order: per
microstep the forward sites in the order the model computes them, then the backward sites in
reverse; then the loss, the gradient norm, the parameters. What the first difference reports:
- loss and gradient norm: exactly, expected and observed bits;
- a parameter tensor: exactly (flat index, expected and observed bits) at steps whose full
  values the golden record holds, otherwise the first differing block of 1/64 of the tensor;
- a site value or gradient: the first differing block (1/64 of the tensor) and how many
  blocks differ; expected values of activations are not stored (that would take 12 MB per
  step for tiny).
A repetition whose digests all agree also compares SHA-256 of its final parameters with the
record's, a cryptographic end-to-end check at the cost of one copy to the host.
Each step's digests are fetched before the next step is dispatched, so that on a difference
the candidate's parameters of that step are still on the device to be compared in full.

Verdicts: PASS (exit 0) only when every step of every repetition was compared and equal;
FAIL (exit 1) when a bit differs; INCONCLUSIVE (exit 2) when the check could not be completed:
a damaged or missing golden file, another environment, a crash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax import lax

from . import config as C
from . import data as D
from . import determinism
from . import faults as F
from . import model, profiles
from . import runfolder as RF
from . import sites as S
from . import train as T
from .config import Config, UserError
from .digest import path_name, tensor_digests, tree_digest

FORMAT = "sdcstudy-golden/1"
REPORT_SCHEMA = "sdcstudy-golden-check/1"
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
BLOCKS = 64  # digest blocks per tensor
FULL_PARAMS_BUDGET = 3 * 2**20  # bytes of full parameter values kept for all steps
MANIFEST, META, ARRAYS, CONFIG, ENV = ("MANIFEST.json", "golden.json", "golden.npz",
                                       "config.yaml", "env.json")
FILES = (CONFIG, ENV, META, ARRAYS)

# The default workload: tiny Llama, 6 steps of 2 microsteps of 4 sequences of 64 tokens.
DEFAULT = {
    "experiment": {"mode": "train", "steps": 6, "microsteps": 2, "batch_size": 4, "seed": 0,
                   "checkpoint_every": 0, "name": "golden"},
    "model": {"preset": "tiny", "dtype": "float32"},
    "optim": {"warmup_steps": 2},
    "data": {"source": "synthetic", "seq_len": 64},
}

# Environment fields a golden record depends on; "os" (kernel version) is reported, not compared.
ENV_FIELDS = ("packages", "xla_flags", "platform", "device_kinds", "device_count",
              "local_device_count", "process_count", "cpu", "compiled_step_sha256")


class GoldenError(Exception):
    """The check cannot be completed (INCONCLUSIVE): damaged golden, other environment, ..."""


# --- the on-device digest ---------------------------------------------------------------------

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _mix(u):
    """An invertible 32-bit integer hash (xor-shift-multiply)."""
    u = u ^ (u >> 16)
    u = u * jnp.uint32(0x7FEB352D)
    u = u ^ (u >> 15)
    u = u * jnp.uint32(0x846CA68B)
    return u ^ (u >> 16)


def n_blocks(size: int) -> int:
    return max(1, min(BLOCKS, size))


def block_range(block: int, size: int) -> tuple[int, int]:
    """[start, stop) of the elements of digest block `block` of a tensor of `size` elements."""
    per = -(-size // n_blocks(size))
    return block * per, min(size, (block + 1) * per)


def block_digest(x) -> jax.Array:
    """uint32 (blocks, 2): the two-lane digest of each block of `x` (see the module docstring)."""
    bits = lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize])
    bits = bits.reshape(-1).astype(jnp.uint32)
    n = bits.size
    blocks = n_blocks(n)
    per = -(-n // blocks)
    bits = jnp.pad(bits, (0, blocks * per - n))
    i = jnp.arange(blocks * per, dtype=jnp.uint32)
    lane_a = _mix(bits) * (2 * i + 1)
    lane_b = _mix(bits ^ jnp.uint32(0x5BD1E995)) * (_mix(i) | 1)
    lanes = jnp.stack([lane_a, lane_b], axis=-1).reshape(blocks, per, 2)
    return jnp.sum(lanes, axis=1, dtype=jnp.uint32)


def _to_float(digest):
    """uint32 -> float32 pairs of exact 16-bit halves (a sink's cotangent must be float)."""
    return jnp.stack([digest >> 16, digest & 0xFFFF], axis=-1).astype(jnp.float32)


def _to_uint(halves):
    halves = halves.astype(jnp.uint32)
    return (halves[..., 0] << 16) | halves[..., 1]


# Backward digest: identity forward; the backward digests the cotangent into `sink`'s gradient.
@jax.custom_vjp
def _tap(x, sink):
    del sink
    return x


def _tap_fwd(x, sink):
    del sink
    return x, None


def _tap_bwd(residuals, ct):
    del residuals
    return ct, _to_float(block_digest(ct))


_tap.defvjp(_tap_fwd, _tap_bwd)


def backward_digest(x, sink):
    """Identity; in the backward, the block digest of the gradient at `x` goes to `sink`."""
    with jax.named_scope("golden_bwd_digest"):
        return _tap(x, sink)


def sink_shape(size: int) -> tuple[int, int, int]:
    return (n_blocks(size), 2, 2)


def site_key(site: str, layer: int) -> str:
    return f"{site}/{layer}"


class DigestHook:
    """A `sites.Hook` that digests every site's value and the gradient arriving at it.

    At one site: forward fault injection, the value digest, the backward digest, backward
    fault injection. The backward injector's VJP therefore runs before the backward digest's,
    so both directions see a fault at their own site, not at the next one.
    """

    def __init__(self, sinks: dict, inject_fwd: S.Hook = S.identity_hook,
                 inject_bwd: S.Hook = S.identity_hook):
        self.sinks, self.inject_fwd, self.inject_bwd = sinks, inject_fwd, inject_bwd
        self.values: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        key = site_key(site, layer)
        x = self.inject_fwd(site, x, layer)
        self.values[key] = block_digest(x)
        x = backward_digest(x, self.sinks[key])
        return self.inject_bwd(site, x, layer)


# --- injection ----------------------------------------------------------------------------------

FLIP_FIELDS = ("step", "site", "layer", "bit", "microstep", "seed")


@dataclasses.dataclass(frozen=True)
class Injection:
    """Faults for `golden check --inject`: a profile, or one flip (`flip:...`)."""

    label: str
    profile: F.Profile
    microstep: int | None = None  # a flip strikes only this microstep
    seed: int = 0
    flip: dict | None = None


def parse_injection(text: str) -> Injection:
    """A zoo profile name, a YAML profile path, or `flip:step=K,site=S,layer=L,bit=B[,...]`."""
    if not text.startswith("flip:"):
        return Injection(text, profiles.load(text))
    fields = {}
    for part in filter(None, text[len("flip:"):].split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in FLIP_FIELDS:
            raise UserError(f"--inject {text!r}: {part!r} is not one of "
                            f"{', '.join(f + '=' for f in FLIP_FIELDS)}.")
        fields[key.strip()] = value.strip()
    missing = [k for k in ("step", "site", "bit") if k not in fields]
    if missing:
        raise UserError(f"--inject {text!r} needs {', '.join(missing)} "
                        f"(e.g. flip:step=3,site=fwd/attn,layer=2,bit=30).")
    try:
        flip = {k: (v if k == "site" else int(v)) for k, v in fields.items()}
    except ValueError:
        raise UserError(f"--inject {text!r}: step, layer, bit, microstep and seed are "
                        f"integers.") from None
    flip.setdefault("microstep", 0)
    flip.setdefault("seed", 0)
    spec = F.FaultSpec(flip["site"], "bitflip", count=1, bits=(flip["bit"],),
                       layers=(flip["layer"],) if "layer" in flip else None,
                       pattern=F.TimePattern("steps", steps=(flip["step"],)))
    try:
        spec.validate(f"--inject {text!r}")
    except F.FaultSpecError as e:
        raise UserError(str(e)) from None
    if spec.direction not in ("fwd", "bwd"):
        raise UserError(f"--inject {text!r}: a flip strikes a model site (fwd/... or bwd/...); "
                        f"use a YAML profile for {spec.site!r}.")
    if spec.resolve()[1] not in S.MODEL_SITES and "layer" not in flip:
        raise UserError(f"--inject {text!r} needs layer= (1 to the number of layers).")
    return Injection(text, F.Profile("flip", (spec,), text), flip["microstep"], flip["seed"],
                     flip)


def _split(injector: F.Injector, direction: str) -> F.Injector:
    """The same injector (same spec indices, so the same draws) restricted to one direction."""
    part = F.Injector(injector.profile, injector.n_layers, injector.limit)
    part.model_specs = [(i, s) for i, s in injector.model_specs if s.direction == direction]
    part.tree_specs = []
    return part


# --- the workload -------------------------------------------------------------------------------


def check_config(cfg: Config) -> None:
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


def pick_device(index: int):
    devices = jax.local_devices()
    if not 0 <= index < len(devices):
        raise UserError(f"--device {index}: this node has {len(devices)} local devices "
                        f"(0 to {len(devices) - 1}).")
    return devices[index]


def device_info(device, index: int) -> dict:
    return {"index": index, "id": device.id, "platform": device.platform,
            "kind": device.device_kind}


class Workload:
    """The golden training on one device, compiled once and run as often as needed."""

    def __init__(self, cfg: Config, tokens: np.ndarray, device, injection: Injection | None = None):
        check_config(cfg)
        self.cfg, self.tokens, self.device, self.injection = cfg, tokens, device, injection
        self.steps, self.microsteps = tokens.shape[0], tokens.shape[1]
        self.trainer = T.Trainer.from_config(cfg)
        self.initial = _initial_state(self.trainer, device)
        self.site_order, self.sites = self._layout()
        self.injector = None
        if injection is not None and not injection.profile.healthy:
            self.injector = F.Injector(injection.profile, self.trainer.dims.n_layers,
                                       cfg.suspect.log_limit)
            self.inject_fwd, self.inject_bwd = (_split(self.injector, d) for d in ("fwd", "bwd"))
        state = self.initial_state()
        self.compiled, self.hlo, self.compile_s = T.compile_step(self._step, state,
                                                                 self._batch(1))
        self._param_digests = jax.jit(lambda p: _digest_tree(p)).lower(state["params"]).compile()

    def _layout(self):
        """Forward order of the sites and their shapes, traced abstractly."""
        order, shapes = [], {}

        def hook(site, x, layer):
            key = site_key(site, layer)
            order.append(key)
            shapes[key] = {"shape": list(x.shape), "dtype": str(x.dtype)}
            return x

        params = jax.eval_shape(lambda: self.trainer.init_state()["params"])
        tokens = jax.ShapeDtypeStruct(self.tokens.shape[2:], jnp.int32)
        jax.eval_shape(lambda p, t: model.token_losses(self.trainer.graphdef, p, t, hook=hook),
                       params, tokens)
        if len(set(order)) != len(order):
            raise ValueError("the model calls the hook twice at one (site, layer).")
        return order, shapes

    def initial_state(self):
        return jax.device_put(self.initial, self.device)

    def _batch(self, step: int) -> dict:
        return {"tokens": jax.device_put(self.tokens[step - 1], self.device)}

    def _sinks(self) -> dict:
        sinks = {"sites": {k: jnp.zeros(sink_shape(int(np.prod(v["shape"]))), jnp.float32)
                           for k, v in self.sites.items()}}
        if self.injector is not None:
            sinks["faults"] = self.injector.init_sinks()
        return sinks

    def _fault_context(self, step, microstep, sinks) -> F.FaultContext:
        key = jax.random.fold_in(self.trainer.base_key, 1)
        if self.injection.seed:
            key = jax.random.fold_in(key, self.injection.seed)
        if self.injection.microstep is not None and microstep is not None:
            # A flip's `steps` pattern names step >= 1; step 0 in the other microsteps turns it off.
            step = jnp.where(microstep == self.injection.microstep, step, 0)
        return F.FaultContext(key, step, jnp.int32(-1) if microstep is None else microstep, sinks)

    def _loss(self, params, sinks, batch, microstep, step):
        records = {}
        if self.injector is None:
            hook = DigestHook(sinks["sites"])
        else:
            ctx = self._fault_context(step, microstep, sinks["faults"])
            hook = DigestHook(sinks["sites"], self.inject_fwd.hook(ctx),
                              self.inject_bwd.hook(ctx))
            records = ctx.records
        loss_sum, count = model.token_losses(self.trainer.graphdef, params, batch["tokens"],
                                             batch.get("mask"), hook=hook)
        return loss_sum, (count, {"fwd": hook.values, "faults": records})

    def _step(self, state: dict, batch: dict):
        """One optimizer step; returns the new state and its digests (all uint32)."""
        step = state["step"] + 1
        loss, grads, (aux_M, sinks_M) = T.accumulate_gradients(
            partial(self._loss, step=step), state["params"], batch, self._sinks())
        transform = lambda u: u  # noqa: E731
        faults = {}
        if self.injector is not None:
            ctx = self._fault_context(step, None, None)
            grads = self.injector.corrupt_tree(grads, ctx, "grad")
            transform = partial(self.injector.corrupt_tree, ctx=ctx, site="update")
            faults = {"micro": {**aux_M["faults"], **sinks_M["faults"]}, "step": ctx.records}
        new_state = T.apply_update(self.trainer.tx, state, grads, transform)
        out = {"loss": lax.bitcast_convert_type(loss.astype(jnp.float32), jnp.uint32),
               "grad_norm": lax.bitcast_convert_type(
                   optax.tree.norm(grads).astype(jnp.float32), jnp.uint32),
               "fwd": aux_M["fwd"],
               "bwd": {k: _to_uint(v) for k, v in sinks_M["sites"].items()},
               "params": _digest_tree(new_state["params"]),
               "faults": faults}
        return new_state, out

    def run(self):
        """Yields (step, digests as numpy, state), step 0 being the initial parameters.

        Each step's digests are fetched before the next step is dispatched (see the module
        docstring); the state yielded is valid until the generator is resumed."""
        state = self.initial_state()
        yield 0, {"params": jax.device_get(self._param_digests(state["params"]))}, state
        for step in range(1, self.steps + 1):
            state, out = self.compiled(state, self._batch(step))
            yield step, jax.device_get(out), state

    def fault_rows(self, faults: dict, step: int) -> list[dict]:
        """Ground truth of what the injection changed at one step."""
        if self.injector is None or not faults:
            return []
        profile = self.injector.profile
        rows, _ = F.record_rows(faults["step"], step, -1, profile)
        for m in range(self.microsteps):
            rows += F.record_rows({k: v[m] for k, v in faults["micro"].items()}, step, m,
                                  profile)[0]
        return rows


_SOURCE_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def program_text(hlo: str) -> str:
    """Compiled HLO text without source locations and op metadata: what the program computes,
    not where it was traced from (file paths and caller line numbers would otherwise make a
    golden record depend on the install path and on which command compiled it)."""
    lines, skipping = [], False
    for line in hlo.splitlines():
        if line in _SOURCE_SECTIONS:
            skipping = True
        elif skipping and not line:
            skipping = False
        elif not skipping:
            lines.append(_METADATA.sub("", line))
    return "\n".join(lines)


# In-process reuse, for callers that check many times in one process (tests, studies): the
# initial state per (config, device) and the last two compiled workloads. A command-line check
# is one process and always starts from nothing.
_INITIAL: dict = {}
_WORKLOADS: dict = {}


def _initial_state(trainer: T.Trainer, device):
    """The initial state, computed on `device` and kept on the host."""
    key = (C.dump(trainer.cfg), device.id)
    if key not in _INITIAL:
        with jax.default_device(device):
            _INITIAL[key] = jax.device_get(trainer.init_state())
    return _INITIAL[key]


def workload(cfg: Config, tokens: np.ndarray, device, injection: Injection | None = None
             ) -> tuple[Workload, bool]:
    """(a Workload for these arguments, whether it was already compiled in this process)."""
    faults = None if injection is None else (injection.profile, injection.microstep,
                                             injection.seed)
    key = (C.dump(cfg), hashlib.sha256(tokens.tobytes()).hexdigest(), tokens.shape, device.id,
           faults)
    cached = key in _WORKLOADS
    if not cached:
        _WORKLOADS[key] = Workload(cfg, tokens, device, injection)
        while len(_WORKLOADS) > 2:
            _WORKLOADS.pop(next(iter(_WORKLOADS)))
    return _WORKLOADS[key], cached


def _digest_tree(tree) -> dict:
    return {path_name(path): block_digest(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _param_leaves(tree) -> dict:
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _bits(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


# --- record -------------------------------------------------------------------------------------


def load_tokens(cfg: Config) -> np.ndarray:
    """int32 (steps, microsteps, batch, seq_len + 1): the inputs of every step."""
    e = cfg.experiment
    batches = D.TokenBatches(D.prepare(cfg.data, e.seed), e.batch_size, e.microsteps)
    return np.stack([batches.batch(step) for step in range(e.steps)]).astype(np.int32)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(folder: Path) -> dict:
    body = {"format": FORMAT,
            "files": {name: {"sha256": _sha256(folder / name),
                             "bytes": (folder / name).stat().st_size} for name in FILES}}
    manifest = {"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    RF.atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def record(cfg: Config, out_dir: Path, *, device_index: int = 0, progress: bool = True) -> dict:
    """Run the golden workload and write GOLDEN_DIR atomically; returns its metadata."""
    out_dir = Path(out_dir)
    check_config(cfg)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"golden folder {str(out_dir)!r} already exists; a golden record is "
                        f"never overwritten: choose another --out.")
    started = time.perf_counter()
    tokens = load_tokens(cfg)
    device = pick_device(device_index)
    work, _ = workload(cfg, tokens, device)
    steps, micro = work.steps, work.microsteps
    arrays = {"tokens": tokens, "loss": np.zeros(steps, np.uint32),
              "grad_norm": np.zeros(steps, np.uint32)}
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(work.initial["params"]))
    full_steps = (list(range(1, steps + 1)) if param_bytes * steps <= FULL_PARAMS_BUDGET
                  else [steps])
    losses, final = [], None
    bar = _bar(progress, steps, "golden record")
    for step, out, state in work.run():
        for path, digest in out["params"].items():
            arrays.setdefault(f"params/{path}", np.zeros((steps + 1,) + digest.shape, np.uint32))
            arrays[f"params/{path}"][step] = digest
        if step == 0:
            continue
        for direction in ("fwd", "bwd"):
            for key, digest in out[direction].items():
                name = f"{direction}/{key}"
                arrays.setdefault(name, np.zeros((steps,) + digest.shape, np.uint32))
                arrays[name][step - 1] = digest
        arrays["loss"][step - 1] = out["loss"]
        arrays["grad_norm"][step - 1] = out["grad_norm"]
        loss = float(np.uint32(out["loss"]).view(np.float32))
        if not np.isfinite(loss):
            raise UserError(f"the golden run's loss became {loss} at step {step}; a golden "
                            f"record needs a finite run (lower optim.lr).")
        losses.append(loss)
        if step in full_steps or step == steps:
            params = jax.device_get(state["params"])
            for path, leaf in _param_leaves(params).items():
                if step in full_steps:
                    arrays[f"full/{step}/{path}"] = _bits(leaf)
            if step == steps:
                final = params
        bar.update(1)
    bar.close()
    leaves = _param_leaves(work.initial["params"])
    meta = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "device": device_info(device, device_index),
        "steps": steps, "microsteps": micro,
        "blocks": BLOCKS,
        "site_order": work.site_order,
        "sites": work.sites,
        "params": {p: {"shape": list(v.shape), "dtype": str(v.dtype)} for p, v in leaves.items()},
        "full_param_steps": full_steps,
        "final_param_sha256": tensor_digests(final),
        "param_digest": tree_digest(final),
        "loss": losses,
        "compile_s": work.compile_s,
        "record_s": time.perf_counter() - started,
    }
    env = determinism.fingerprint(program_text(work.hlo))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        RF.atomic_write_text(tmp / CONFIG, C.dump(cfg))
        RF.atomic_write_json(tmp / ENV, env)
        RF.atomic_write_json(tmp / META, meta)
        with open(tmp / ARRAYS, "wb") as f:
            np.savez_compressed(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        manifest = write_manifest(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.iterdir():  # mkstemp and mkdtemp make private files; a golden is shared
            path.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        try:
            os.rename(tmp, out_dir)  # atomic; refuses a folder that filled in the meantime
        except OSError as e:
            raise UserError(f"could not move the golden record into {str(out_dir)!r} "
                            f"({e.strerror}); nothing there was changed.") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    meta["manifest_sha256"] = manifest["sha256"]
    meta["bytes"] = sum(f["bytes"] for f in manifest["body"]["files"].values())
    meta["golden_dir"] = str(out_dir)
    return meta


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not progress, dynamic_ncols=True)


# --- loading and verifying a golden record -------------------------------------------------------


def verify(golden_dir: Path) -> dict:
    """The manifest, after checking its own checksum and every file's; GoldenError otherwise."""
    golden_dir = Path(golden_dir)
    if not golden_dir.is_dir():
        raise GoldenError(f"golden folder {str(golden_dir)!r} does not exist.")
    try:
        manifest = json.loads((golden_dir / MANIFEST).read_text())
        body, claimed = manifest["body"], manifest["sha256"]
        files = body["files"]
    except FileNotFoundError:
        raise GoldenError(f"{MANIFEST} is missing from {str(golden_dir)!r}.") from None
    except (ValueError, KeyError, TypeError):
        raise GoldenError(f"{MANIFEST} in {str(golden_dir)!r} is damaged (not a golden "
                          f"manifest).") from None
    if hashlib.sha256(_canonical(body)).hexdigest() != claimed:
        raise GoldenError(f"{MANIFEST} in {str(golden_dir)!r} is damaged (its checksum does "
                          f"not match its contents).")
    if body.get("format") != FORMAT:
        raise GoldenError(f"golden record format {body.get('format')!r} is not {FORMAT!r}; "
                          f"record it again with this version.")
    for name in FILES:
        path = golden_dir / name
        if name not in files:
            raise GoldenError(f"{MANIFEST} does not list {name}.")
        if not path.is_file():
            raise GoldenError(f"golden file {name} is missing from {str(golden_dir)!r}.")
        if _sha256(path) != files[name]["sha256"]:
            raise GoldenError(f"golden file {name} in {str(golden_dir)!r} is damaged (SHA-256 "
                              f"differs from the manifest).")
    return manifest


def load(golden_dir: Path) -> tuple[Config, dict, dict, dict]:
    """(config, env, meta, arrays) of a verified golden folder."""
    golden_dir = Path(golden_dir)
    try:
        cfg = C.from_dict(yaml.safe_load((golden_dir / CONFIG).read_text()))
    except UserError as e:
        raise GoldenError(f"the golden config is not valid here: {e}") from None
    env = RF.json_load(golden_dir / ENV)
    meta = RF.json_load(golden_dir / META)
    with np.load(golden_dir / ARRAYS, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return cfg, env, meta, arrays


# --- comparing ----------------------------------------------------------------------------------


def _flatten_env(env: dict) -> dict:
    flat = {}
    for name in ENV_FIELDS:
        value = env.get(name)
        if name == "xla_flags":
            value = " ".join(sorted(str(value or "").split()))
        if isinstance(value, dict):
            for key in sorted(value):
                flat[f"{name}.{key}"] = value[key]
        else:
            flat[name] = value
    return flat


def env_differences(golden: dict, observed: dict, skip: tuple[str, ...] = ()) -> list[dict]:
    a, b = _flatten_env(golden), _flatten_env(observed)
    return [{"field": k, "golden": a.get(k), "observed": b.get(k)}
            for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k.split(".")[0] not in skip]


def _first_block(expected: np.ndarray, observed: np.ndarray) -> tuple[int, int]:
    """(first differing block, number of differing blocks) of two (blocks, 2) digests."""
    differ = np.any(expected != observed, axis=-1)
    return int(np.argmax(differ)), int(np.sum(differ))


def _scalar(name: str, expected: int, observed: int) -> dict:
    xor = int(expected) ^ int(observed)
    value = lambda b: float(np.uint32(b).view(np.float32))  # noqa: E731
    return {"kind": name, "exact": True, "expected_bits": f"0x{int(expected):08x}",
            "observed_bits": f"0x{int(observed):08x}", "expected": value(expected),
            "observed": value(observed), "differing_bits": [b for b in range(32) if xor >> b & 1]}


def step_differences(step: int, out: dict, arrays: dict, meta: dict) -> list[dict]:
    """Every differing digest of one step, in program order (the first is where it began)."""
    found = []
    if step > 0:
        order = meta["site_order"]
        for m in range(meta["microsteps"]):
            for direction, keys in (("fwd", order), ("bwd", order[::-1])):
                for key in keys:
                    expected = arrays[f"{direction}/{key}"][step - 1, m]
                    observed = out[direction][key][m]
                    if not np.array_equal(expected, observed):
                        found.append({"kind": "site", "direction": direction, "key": key,
                                      "microstep": m, "expected": expected, "observed": observed})
        for name in ("loss", "grad_norm"):
            if arrays[name][step - 1] != out[name]:
                found.append({"kind": name, "expected": arrays[name][step - 1],
                              "observed": out[name]})
    for path in meta["params"]:
        expected, observed = arrays[f"params/{path}"][step], out["params"][path]
        if not np.array_equal(expected, observed):
            found.append({"kind": "parameter", "path": path, "expected": expected,
                          "observed": observed})
    return found


def _site_name(direction: str, site: str) -> str:
    for alias, (d, s) in F.SITE_ALIASES.items():
        if (d, s) == (direction, site):
            return alias
    return f"{direction}/{site}"


def describe(diff: dict, step: int, meta: dict, arrays: dict, state) -> dict:
    """The report entry of one difference, with the element or block where it lies."""
    where = {"step": step}
    if diff["kind"] in ("loss", "grad_norm"):
        return {**where, **_scalar(diff["kind"], diff["expected"], diff["observed"])}
    if diff["kind"] == "site":
        site, layer = diff["key"].rsplit("/", 1)
        info = meta["sites"][diff["key"]]
        shape = tuple(info["shape"])
        block, blocks = _first_block(diff["expected"], diff["observed"])
        start, stop = block_range(block, int(np.prod(shape)))
        return {**where, "kind": "activation" if diff["direction"] == "fwd" else "gradient",
                "microstep": diff["microstep"], "layer": int(layer),
                "site": f"{diff['direction']}/{site}",
                "paper_site": _site_name(diff["direction"], site),
                "shape": list(shape), "dtype": info["dtype"], "exact": False,
                "block": {"index": block, "of": n_blocks(int(np.prod(shape))),
                          "flat_start": start, "flat_stop": stop,
                          "start": [int(i) for i in np.unravel_index(start, shape)]},
                "differing_blocks": blocks}
    path = diff["path"]
    info = meta["params"][path]
    shape = tuple(info["shape"])
    entry = {**where, "kind": "parameter", "tensor": path, "shape": list(shape),
             "dtype": info["dtype"]}
    full = arrays.get(f"full/{step}/{path}")
    if full is not None and state is not None:
        observed = _bits(jax.device_get(_param_leaves(state["params"])[path])).reshape(-1)
        expected = full.reshape(-1)
        differ = expected != observed
        if np.any(differ):
            index = int(np.argmax(differ))
            e, o = int(expected[index]), int(observed[index])
            width = 8 * expected.dtype.itemsize
            value = lambda b: float(np.array([b], expected.dtype).view(  # noqa: E731
                np.float32 if width == 32 else jnp.bfloat16)[0])
            return {**entry, "exact": True, "index": index,
                    "multi_index": [int(i) for i in np.unravel_index(index, shape)],
                    "expected_bits": f"0x{e:0{width // 4}x}",
                    "observed_bits": f"0x{o:0{width // 4}x}",
                    "expected": value(e), "observed": value(o),
                    "differing_bits": [b for b in range(width) if (e ^ o) >> b & 1],
                    "differing_elements": int(np.sum(differ))}
    block, blocks = _first_block(diff["expected"], diff["observed"])
    start, stop = block_range(block, int(np.prod(shape)))
    return {**entry, "exact": False,
            "block": {"index": block, "of": n_blocks(int(np.prod(shape))), "flat_start": start,
                      "flat_stop": stop, "start": [int(i) for i in np.unravel_index(start, shape)]},
            "differing_blocks": blocks}


def _short(diff: dict) -> str:
    if diff["kind"] == "site":
        return f"m{diff['microstep']} {diff['direction']}/{diff['key']}"
    return diff.get("path", diff["kind"])


def _check_layout(work: Workload, meta: dict, arrays: dict) -> None:
    """The golden record must describe exactly the program that runs here."""
    if (meta.get("steps"), meta.get("microsteps")) != (work.steps, work.microsteps):
        raise GoldenError("golden.json disagrees with the recorded tokens (steps, microsteps).")
    if meta.get("site_order") != work.site_order or meta.get("sites") != work.sites:
        raise GoldenError("the golden record's sites differ from this program's (another "
                          "model version?).")
    leaves = _param_leaves(work.initial["params"])
    if set(meta.get("params", {})) != set(leaves):
        raise GoldenError("the golden record's parameter tensors differ from this program's.")
    wanted = {f"{d}/{k}" for d in ("fwd", "bwd") for k in work.site_order}
    wanted |= {f"params/{p}" for p in leaves} | {"loss", "grad_norm"}
    missing = sorted(wanted - set(arrays))
    if missing:
        raise GoldenError(f"{ARRAYS} lacks {len(missing)} arrays (first: {missing[0]}).")


def run_once(work: Workload, meta: dict, arrays: dict, progress: bool = False) -> dict:
    """One repetition of the workload against the golden digests."""
    started = time.perf_counter()
    result = {"verdict": INCONCLUSIVE, "steps_compared": 0, "first_difference": None,
              "injected": []}
    bar = _bar(progress, work.steps, "golden check")
    try:
        for step, out, state in work.run():
            if step > 0:
                result["injected"] += work.fault_rows(out.get("faults"), step)
            found = step_differences(step, out, arrays, meta)
            if found:
                result.update(verdict=FAIL, steps_compared=step,
                              first_difference=describe(found[0], step, meta, arrays, state),
                              differences_at_step=len(found),
                              differing=[_short(d) for d in found[:20]])
                if step > 0:
                    result["first_difference"]["observed_loss"] = float(
                        np.uint32(out["loss"]).view(np.float32))
                break
            result["steps_compared"] = step
            bar.update(int(step > 0))
        else:
            final = tensor_digests(jax.device_get(state["params"]))
            if result["steps_compared"] != work.steps:
                result["reason"] = (f"only {result['steps_compared']} of {work.steps} steps "
                                    f"were compared.")
            elif final != meta["final_param_sha256"]:
                golden = meta["final_param_sha256"]
                wrong = sorted(p for p in final.keys() | golden.keys()
                               if final.get(p) != golden.get(p))
                result.update(verdict=FAIL, first_difference={
                    "step": work.steps, "kind": "parameter", "tensor": wrong[0], "exact": False,
                    "sha256_only": True, "differing_tensors": wrong})
            else:
                result["verdict"] = PASS
    finally:
        bar.close()
    result["wall_s"] = time.perf_counter() - started
    return result


def check(golden_dir: Path, *, inject: str | None = None, allow_env_drift: bool = False,
          repeat: int = 1, duration_min: float | None = None, device_index: int = 0,
          progress: bool = False) -> dict:
    """Verify, re-run and compare; the report (see docs/golden.md). Never raises for a
    problem with the golden record, the environment or the run: those are INCONCLUSIVE."""
    started = time.perf_counter()
    report = {"schema": REPORT_SCHEMA, "verdict": INCONCLUSIVE, "exit_code": 2, "reason": None,
              "golden": {"dir": str(golden_dir)}, "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": {"index": device_index},
              "inject": inject, "env": {"compared": False, "differences": [],
                                        "allowed_drift": allow_env_drift},
              "failed_stage": None, "repetitions": [], "first_difference": None, "injected": None,
              "timing": {}}

    def finish(verdict: str, reason: str | None = None, stage: str | None = None) -> dict:
        report.update(verdict=verdict, exit_code=EXIT_CODES[verdict], reason=reason,
                      failed_stage=stage)
        report["timing"]["total_s"] = time.perf_counter() - started
        return report

    try:
        manifest = verify(golden_dir)
        report["golden"]["manifest_sha256"] = manifest["sha256"]
        cfg, golden_env, meta, arrays = load(golden_dir)
        report["golden"].update(steps=meta.get("steps"), microsteps=meta.get("microsteps"),
                                preset=cfg.model.preset, created=meta.get("created"),
                                recorded_on=meta.get("host"))
        injection = parse_injection(inject) if inject else None
        device = pick_device(device_index)
        report["device"] = device_info(device, device_index)
        if injection is not None and injection.flip is not None:
            _check_flip(injection.flip, meta)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "golden")
    except Exception as e:  # a crash while loading is no verdict on the node
        return finish(INCONCLUSIVE, f"could not read the golden record: {type(e).__name__}: {e}",
                      "golden")

    # The environment first (before compiling: a node on another stack fails fast), then the
    # compiled program. An injected program differs from the golden one by construction, so
    # its hash is not compared; everything else about the environment still is.
    env = report["env"]

    def env_verdict(differences):
        env["differences"] += differences
        if differences and not allow_env_drift:
            fields = ", ".join(d["field"] for d in differences)
            return finish(INCONCLUSIVE, f"the environment differs from the golden record's in "
                                        f"{fields}; record a golden run for this stack, or "
                                        f"pass --allow-env-drift.", "environment")
        return None

    observed_env = determinism.fingerprint(None)
    env.update(compared=True, skipped=[],
               os={"golden": golden_env.get("os"), "observed": observed_env.get("os")})
    if env_verdict(env_differences(golden_env, observed_env, skip=("compiled_step_sha256",))):
        return report
    try:
        work, cached = workload(cfg, arrays["tokens"], device, injection)
        report["timing"].update(compile_s=0.0 if cached else work.compile_s,
                                compiled_earlier_in_process=cached)
        _check_layout(work, meta, arrays)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "workload")
    except Exception as e:
        return finish(INCONCLUSIVE, f"could not build the golden workload: "
                                    f"{type(e).__name__}: {e}", "workload")
    if work.injector is not None:
        env["skipped"] = ["compiled_step_sha256"]
    else:
        observed = determinism.fingerprint(program_text(work.hlo))["compiled_step_sha256"]
        expected = golden_env.get("compiled_step_sha256")
        if env_verdict([] if observed == expected else [
                {"field": "compiled_step_sha256", "golden": expected, "observed": observed}]):
            return report

    deadline = None if duration_min is None else started + 60.0 * duration_min
    landed = []
    while True:
        index = len(report["repetitions"]) + 1
        try:
            result = run_once(work, meta, arrays, progress)
        except Exception as e:
            result = {"verdict": INCONCLUSIVE, "steps_compared": None, "first_difference": None,
                      "injected": [], "reason": f"the run failed: {type(e).__name__}: {e}"}
        result["repetition"] = index
        landed += [dict(r, repetition=index) for r in result.pop("injected")]
        report["repetitions"].append(result)
        if result["verdict"] != PASS:
            break
        if deadline is None and index >= repeat:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            break
    if work.injector is not None:
        report["injected"] = {"label": injection.label, "landed": len(landed),
                              "first": landed[:20]}
    report["timing"]["run_s"] = sum(r.get("wall_s", 0.0) for r in report["repetitions"])
    last = report["repetitions"][-1]
    if last["verdict"] == FAIL:
        report["first_difference"] = dict(last["first_difference"], repetition=index)
        return finish(FAIL, _sentence(report["first_difference"]), "run")
    if last["verdict"] == INCONCLUSIVE:
        return finish(INCONCLUSIVE, last.get("reason"), "run")
    return finish(PASS, f"{len(report['repetitions'])} repetition(s) of {meta['steps']} steps "
                        f"bitwise equal to the golden record.")


def _check_flip(flip: dict, meta: dict) -> None:
    """A flip that can never land would let the check pass without proving anything."""
    steps, micro = meta["steps"], meta["microsteps"]
    if not 1 <= flip["step"] <= steps:
        raise UserError(f"--inject flip: step must be 1 to {steps}, not {flip['step']}.")
    if not 0 <= flip["microstep"] < micro:
        raise UserError(f"--inject flip: microstep must be 0 to {micro - 1}.")
    site = F.FaultSpec(flip["site"]).resolve()[1]
    keys = [k for k in meta["site_order"] if k.rsplit("/", 1)[0] == site]
    if "layer" in flip and site_key(site, flip["layer"]) not in keys:
        layers = sorted(int(k.rsplit("/", 1)[1]) for k in keys)
        raise UserError(f"--inject flip: site {flip['site']!r} has layers {layers}, not "
                        f"{flip['layer']}.")
    dtype = meta["sites"][keys[0]]["dtype"]
    width = 16 if dtype == "bfloat16" else 32
    if not 0 <= flip["bit"] < width:
        raise UserError(f"--inject flip: bit must be 0 to {width - 1} for {dtype}.")


def _sentence(d: dict) -> str:
    where = f"step {d['step']}"
    if "microstep" in d:
        where += f", microstep {d['microstep']}"
    if d["kind"] in ("activation", "gradient"):
        b = d["block"]
        alias = f" ({d['paper_site']})" if d["paper_site"] != d["site"] else ""
        return (f"{where}, layer {d['layer']}, {d['site']}{alias}: the {d['kind']} differs first "
                f"in block {b['index']} of {b['of']} (elements {b['flat_start']}-"
                f"{b['flat_stop'] - 1} of shape {tuple(d['shape'])}), {d['differing_blocks']} "
                f"block(s) differ")
    if d["kind"] == "parameter":
        if d.get("sha256_only"):
            return (f"{where}: SHA-256 of the final parameters {', '.join(d['differing_tensors'])} "
                    f"differs from the record's although every digest agreed")
        if d["exact"]:
            return (f"{where}: parameter {d['tensor']} element {tuple(d['multi_index'])} is "
                    f"{d['observed_bits']} ({d['observed']:.9g}), expected {d['expected_bits']} "
                    f"({d['expected']:.9g}); {d['differing_elements']} element(s) differ")
        b = d["block"]
        return (f"{where}: parameter {d['tensor']} differs first in block {b['index']} of "
                f"{b['of']} (elements {b['flat_start']}-{b['flat_stop'] - 1})")
    return (f"{where}: {d['kind']} is {d['observed_bits']} ({d['observed']:.9g}), expected "
            f"{d['expected_bits']} ({d['expected']:.9g})")


# --- reports ------------------------------------------------------------------------------------


def junit_xml(report: dict) -> str:
    """JUnit XML: one test case per stage (golden record, environment, workload) and per
    repetition; FAIL is a <failure>, INCONCLUSIVE an <error>, stages not reached <skipped>."""
    label = f"device{report['device'].get('index')}"
    failed = report.get("failed_stage")
    cases, reached = [], True
    for stage, name in (("golden", "golden record"), ("environment", "environment"),
                        ("workload", "workload compiles")):
        if not reached:
            cases.append((name, ("skipped", "not reached"), 0.0))
            continue
        cases.append((name, ("error", report["reason"]) if failed == stage else None, 0.0))
        reached = failed != stage
    for rep in report["repetitions"]:
        outcome = None
        if rep["verdict"] == FAIL:
            outcome = ("failure", _sentence(rep["first_difference"]))
        elif rep["verdict"] == INCONCLUSIVE:
            outcome = ("error", rep.get("reason") or "incomplete")
        cases.append((f"repetition {rep['repetition']}", outcome, rep.get("wall_s", 0.0)))
    count = lambda tag: str(sum(1 for c in cases if c[1] and c[1][0] == tag))  # noqa: E731
    suite = ET.Element("testsuite", name=f"sdcstudy.golden.{label}", hostname=report["host"],
                       timestamp=report["started"], tests=str(len(cases)),
                       failures=count("failure"), errors=count("error"), skipped=count("skipped"),
                       time=f"{report['timing'].get('total_s', 0.0):.3f}")
    props = ET.SubElement(suite, "properties")
    for name, value in (("verdict", report["verdict"]), ("golden", report["golden"]["dir"]),
                        ("device", json.dumps(report["device"])),
                        ("inject", report["inject"] or "")):
        ET.SubElement(props, "property", name=name, value=str(value))
    for name, outcome, seconds in cases:
        case = ET.SubElement(suite, "testcase", classname=f"sdcstudy.golden.{label}", name=name,
                             time=f"{seconds:.3f}")
        if outcome:
            tag, message = outcome
            node = ET.SubElement(case, tag, message=message or "")
            if tag != "skipped":
                node.set("type", report["verdict"])
                node.text = message
    root = ET.Element("testsuites", name="sdcstudy golden check")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _strict(value):
    """JSON has no NaN or Inf (a corrupted loss may be either): write them as strings."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return str(float(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def report_json(report: dict) -> str:
    return json.dumps(_strict(report), indent=2, allow_nan=False) + "\n"


# --- command line -------------------------------------------------------------------------------


def main(args) -> int:
    if args.golden_command == "record":
        cfg = (C.load(args.config, args.overrides) if args.config is not None
               else C.from_dict(DEFAULT, args.overrides))
        meta = record(cfg, args.out, device_index=args.device, progress=not args.no_progress)
        print(f"golden record: {meta['golden_dir']} ({meta['steps']} steps x "
              f"{meta['microsteps']} microsteps, {len(meta['site_order'])} sites, "
              f"{meta['bytes'] / 1e6:.2f} MB, manifest sha256 {meta['manifest_sha256'][:16]}...)")
        return 0
    if args.repeat is not None and args.repeat < 1:
        raise UserError("--repeat must be at least 1.")
    if args.duration is not None and args.duration <= 0:
        raise UserError("--duration must be a positive number of minutes.")
    report = check(args.golden_dir, inject=args.inject, allow_env_drift=args.allow_env_drift,
                   repeat=args.repeat or 1, duration_min=args.duration, device_index=args.device,
                   progress=not args.no_progress)
    for path, text in ((args.json, report_json), (args.junit, junit_xml)):
        if path is not None:
            RF.atomic_write_text(Path(path), text(report))
    reps = len(report["repetitions"])
    t = report["timing"]
    print(f"golden check {report['verdict']}: {report['reason']}")
    if reps:
        print(f"  device {report['device'].get('index')} ({report['device'].get('kind')}), "
              f"{reps} repetition(s), compile {t.get('compile_s', 0):.1f} s, run "
              f"{t.get('run_s', 0):.1f} s, total {t.get('total_s', 0):.1f} s")
    if report["injected"] is not None:
        print(f"  injected {report['injected']['label']}: {report['injected']['landed']} "
              f"corruption(s) landed")
    return report["exit_code"]


__all__ = ["record", "check", "verify", "load", "parse_injection", "block_digest", "Workload",
           "junit_xml", "DEFAULT", "PASS", "FAIL", "INCONCLUSIVE", "EXIT_CODES"]
