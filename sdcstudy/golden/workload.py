"""The golden workload: a deterministic training on one device, compiled once, whose step
returns the digests (`golden_digest`) of every site value, every gradient arriving at a site and
every parameter, with the faults of `golden check --inject` composed into its hooks.

Each step's digests are fetched before the next step is dispatched, so that on a difference
the candidate's parameters of that step are still on the device to be compared in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sdcstudy import features as FT
from sdcstudy.core import config as C
from sdcstudy.faults import specs as FS
from sdcstudy.core.compose import open_step
from sdcstudy.core.step import Place, Records, StepOut, Where
from sdcstudy.core import model
from sdcstudy.faults import profiles
from sdcstudy.core import sites as S
from sdcstudy.core import train as T
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.digest import path_name
from sdcstudy.core.errors import CouldNotRun, first_line
from sdcstudy.golden import coverage
from sdcstudy.golden.contents import check_config  # noqa: F401  (importable here)
from sdcstudy.golden.digest import DigestHook, _to_uint, block_digest, site_key, sink_shape
from sdcstudy.golden.sizing import FullSizing


# --- injection ----------------------------------------------------------------------------------

FLIP_FIELDS = ("step", "site", "layer", "bit", "microstep", "seed")


@dataclasses.dataclass(frozen=True)
class Injection:
    """Faults for `golden check --inject`: a profile, or one flip (`flip:...`)."""

    label: str
    profile: FS.Profile
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
    direction, site = FS.FaultSpec(flip["site"]).resolve()
    if direction not in ("fwd", "bwd") or flip["site"] in FS.MODEL_COLLECTIVES:
        # a collective of tensor parallelism: the golden device has none to strike
        raise UserError(f"--inject {text!r}: a flip strikes a model site (fwd/... or bwd/...); "
                        f"use a YAML profile for {flip['site']!r}.")
    if flip.get("layer", 0) != 0 and site in S.MODEL_SITES:
        raise UserError(f"--inject {text!r}: {flip['site']} lies outside the blocks, so it "
                        f"takes no layer=; remove layer={flip['layer']}.")
    spec = FS.FaultSpec(flip["site"], "bitflip", count=1, bits=(flip["bit"],),
                        layers=(flip["layer"],) if "layer" in flip else None,
                        pattern=FS.TimePattern("steps", steps=(flip["step"],)))
    try:
        spec.validate(f"--inject {text!r}")
    except FS.FaultSpecError as e:
        raise UserError(str(e)) from None
    if site not in S.MODEL_SITES and "layer" not in flip:
        raise UserError(f"--inject {text!r} needs layer= (1 to the number of layers).")
    return Injection(text, FS.Profile("flip", (spec,), text), flip["microstep"], flip["seed"],
                     flip)


# --- the workload -------------------------------------------------------------------------------


def backend_devices() -> list:
    """The local devices; CouldNotRun (exit 3, one sentence) when the backend does not start:
    that is no verdict on the node and no fault of the user's input."""
    try:
        return jax.local_devices()
    except Exception as e:  # jax raises RuntimeError, a plugin may assert
        raise CouldNotRun(f"the accelerator backend did not start ({type(e).__name__}: "
                          f"{first_line(e, 200)}); check the driver and the JAX installation.") from None


def pick_device(index: int):
    devices = backend_devices()
    if not 0 <= index < len(devices):
        raise UserError(f"--device {index}: this node has {len(devices)} local devices "
                        f"(0 to {len(devices) - 1}).")
    return devices[index]


def device_info(device, index: int) -> dict:
    return {"index": index, "id": device.id, "platform": device.platform,
            "kind": device.device_kind}


class Workload:
    """The golden training on one device, compiled once and run as often as needed; with a
    `sizing`, the full workload (`golden.coverage`'s buffer and products beside the model)."""

    def __init__(self, cfg: Config, tokens: np.ndarray, device, injection: Injection | None = None,
                 sizing: FullSizing | None = None):
        check_config(cfg)
        self.cfg, self.tokens, self.device, self.injection = cfg, tokens, device, injection
        self.sizing = sizing
        self.steps, self.microsteps = tokens.shape[0], tokens.shape[1]
        self.trainer = T.Trainer.from_config(cfg)
        self.initial = _initial_state(self.trainer, device)
        self.site_order, self.sites = self._layout()
        self.faults = None if injection is None else FT.FEATURES["faults"].from_profile(
            injection.profile, self.trainer.dims.n_layers, cfg.suspect.log_limit)
        state = jax.device_put(self.initial, device)
        if sizing is not None:
            state["coverage"] = coverage.abstract_state(sizing, device)
            self._coverage_init = jax.jit(
                partial(coverage.init_state, sizing),
                out_shardings=jax.sharding.SingleDeviceSharding(device))
        self.compiled, self.hlo, self.compile_s = T.compile_step(self._step, state,
                                                                 self._batch(1))
        self._param_digests = jax.jit(lambda p: _digest_tree(p)).lower(state["params"]).compile()

    def _layout(self):
        return site_layout(self.trainer, self.tokens.shape[2:])

    def initial_state(self):
        state = jax.device_put(self.initial, self.device)
        if self.sizing is not None:
            state["coverage"] = self._coverage_init()
        return state

    def _batch(self, step: int) -> dict:
        return {"tokens": jax.device_put(self.tokens[step - 1], self.device)}

    def _sinks(self) -> dict:
        sinks = {"sites": {k: jnp.zeros(sink_shape(int(np.prod(v["shape"]))), jnp.float32)
                           for k, v in self.sites.items()}}
        if self.faults is not None:
            sinks["faults"] = self.faults.init_sinks()
        return sinks

    @property
    def features(self) -> list:
        """The golden step's features: the injection's faults, if any."""
        return [] if self.faults is None else [self.faults]

    def _where(self, step, microstep=None) -> Where:
        """Where the injection's draws are made; microstep None: the step's tree sites."""
        injection = self.injection
        if injection is not None and injection.microstep is not None and microstep is not None:
            # A flip's `steps` pattern names step >= 1; step 0 in the other microsteps turns it off.
            step = jnp.where(microstep == injection.microstep, step, 0)
        return Where(self.trainer.base_key, step,
                     jnp.int32(-1) if microstep is None else microstep,
                     fold=(injection.seed,) if injection is not None and injection.seed else ())

    def _loss(self, params, sinks, batch, microstep, step):
        """The digests wrap the faults' own direction hooks at each site (`DigestHook`): a
        backward fault is seen by its own site's backward digest, not the next one's."""
        records = {}
        if self.faults is None:
            hook = DigestHook(sinks["sites"])
        else:
            ctx = self.faults.context(self._where(step, microstep), sinks["faults"])
            hook = DigestHook(sinks["sites"], *self.faults.direction_hooks(ctx))
            records = ctx.records
        loss_sum, count = model.token_losses(self.trainer.graphdef, params, batch["tokens"],
                                             batch.get("mask"), hook=hook)
        return loss_sum, (count, {"fwd": hook.values, "faults": records})

    def _step(self, state: dict, batch: dict) -> StepOut:
        """One optimizer step: the new state, the loss and gradient norm as bits ("loss",
        "grad_norm", uint32), and the records: the digests ("golden": "fwd", "bwd",
        "params", with a sizing "coverage", all uint32) and the injection's ("faults")."""
        step = state["step"] + 1
        loss, grads, records_M = T.accumulate_gradients(
            partial(self._loss, step=step), state["params"], batch, self._sinks())
        features = open_step(self.features, self._where(step), records_M)
        grads = features.transform_grads(grads)
        new_state = T.apply_update(self.trainer.tx, state, grads, features.transform_updates)
        aux_M, sinks_M = records_M
        metrics = {"loss": lax.bitcast_convert_type(loss.astype(jnp.float32), jnp.uint32),
                   "grad_norm": lax.bitcast_convert_type(
                       optax.tree.norm(grads).astype(jnp.float32), jnp.uint32)}
        digests = {"fwd": aux_M["fwd"],
                   "bwd": {k: _to_uint(v) for k, v in sinks_M["sites"].items()},
                   "params": _digest_tree(new_state["params"])}
        if self.sizing is not None:
            new_state["coverage"], digests["coverage"] = coverage.step(state["coverage"], step)
        return StepOut(new_state, metrics, Records(golden=digests, **features.records()))

    def run(self):
        """Yields (step, digests as numpy, state), step 0 being the initial parameters; a
        step's digests: its metrics, its "golden" records and its "faults" records, by name.

        Each step's digests are fetched before the next step is dispatched (see the module
        docstring); the state yielded is valid until the generator is resumed."""
        state = self.initial_state()
        yield 0, {"params": jax.device_get(self._param_digests(state["params"]))}, state
        for step in range(1, self.steps + 1):
            out = self.compiled(state, self._batch(step))
            state = out.state
            metrics, records = jax.device_get((out.metrics, out.records))
            yield step, {**metrics, **records["golden"], "faults": records.get("faults", {})}, \
                state

    def fault_rows(self, faults: dict, step: int) -> list[dict]:
        """Ground truth of what the injection changed at one step."""
        if self.faults is None or not faults:
            return []
        return self.faults.rows(faults, step, [Place()], self.microsteps)[0]


# In-process reuse, for callers that check many times in one process (tests, studies): the
# initial state per (config, device) and the last two compiled workloads. A command-line check
# is one process and always starts from nothing. The lock guards the dictionaries only (checks
# of several devices compile concurrently, in threads).
_INITIAL: dict = {}
_WORKLOADS: dict = {}
_LOCK = threading.Lock()


def site_layout(trainer: T.Trainer, token_shape) -> tuple[list, dict]:
    """Forward order of the sites and their shapes, traced abstractly (nothing compiles)."""
    order, shapes = [], {}

    def hook(site, x, layer):
        key = site_key(site, layer)
        order.append(key)
        shapes[key] = {"shape": list(x.shape), "dtype": str(x.dtype)}
        return x

    params = jax.eval_shape(lambda: trainer.init_state()["params"])
    tokens = jax.ShapeDtypeStruct(tuple(token_shape), jnp.int32)
    jax.eval_shape(lambda p, t: model.token_losses(trainer.graphdef, p, t, hook=hook),
                   params, tokens)
    if len(set(order)) != len(order):
        raise ValueError("the model calls the hook twice at one (site, layer).")
    return order, shapes


def layout(cfg: Config, tokens: np.ndarray) -> dict:
    """What a flip is checked against (`check._check_flip`), before any device compiles."""
    order, sites = site_layout(T.Trainer.from_config(cfg), tokens.shape[2:])
    return {"steps": tokens.shape[0], "microsteps": tokens.shape[1], "site_order": order,
            "sites": sites}


def _initial_state(trainer: T.Trainer, device):
    """The initial state, computed on `device` and kept on the host."""
    key = (C.dump(trainer.cfg), device.id)
    with _LOCK:
        initial = _INITIAL.get(key)
    if initial is None:
        with jax.default_device(device):
            initial = jax.device_get(trainer.init_state())
        with _LOCK:
            _INITIAL[key] = initial
    return initial


def workload(cfg: Config, tokens: np.ndarray, device, injection: Injection | None = None,
             sizing: FullSizing | None = None) -> tuple[Workload, bool]:
    """(a Workload for these arguments, whether it was already compiled in this process)."""
    faults = None if injection is None else (injection.profile, injection.microstep,
                                             injection.seed)
    key = (C.dump(cfg), hashlib.sha256(tokens.tobytes()).hexdigest(), tokens.shape, device.id,
           faults, sizing)
    with _LOCK:
        work = _WORKLOADS.get(key)
    if work is not None:
        return work, True
    work = Workload(cfg, tokens, device, injection, sizing)
    with _LOCK:
        _WORKLOADS[key] = work
        while len(_WORKLOADS) > 2:
            _WORKLOADS.pop(next(iter(_WORKLOADS)))
    return work, False


def _digest_tree(tree) -> dict:
    return {path_name(path): block_digest(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _param_leaves(tree) -> dict:
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _bits(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")
