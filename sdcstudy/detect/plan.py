"""Which computations a detector step runs: the executions of `experiment.mode: detect`.

A data-parallel step on `mesh.dp` ranks; rank d computes its microbatch on device d, and the
device of rank `detect.suspect_rank` is faulty. Each detector adds executions of the same step
on other devices (or again on the same one), and compares gradients bit for bit:

- `shadow` (Ma et al. section 7.2): one chosen rank's microbatch again on a spare, healthy
  device (`detect.shadow_rank`, or round robin over ranks);
- `reexec`: every rank's microbatch again on its own device, with the next attempt number, so
  only transient faults (`suspect.fault_kind: transient`) draw differently;
- `lockstep`: every rank mirrored on a healthy device (the reference; it detects, but a pair
  cannot say which side is wrong);
- `localize`: `detect.replicas` (>= 3) copies of every rank's step on distinct devices; the
  one that disagrees with all the others, which agree, is named (in the spirit of C4's
  localization of a faulty rank from the homogeneity of collective statistics, Dong et al.);
- `monitor` (loss / gradient-norm spikes, non-finite values) and `abft` (checksummed matmuls)
  add no execution.

Imports no JAX: the config validates against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sdcstudy.core.errors import ConfigError, did_you_mean

DETECTORS = ("monitor", "abft", "shadow", "reexec", "lockstep", "localize")
ADVANCE = ("reference", "primary")


@dataclass(frozen=True)
class Execution:
    role: str  # primary, reexec, shadow, or replica (replica 1 is the lock-step mirror)
    rank: int  # whose microbatch; -1 for the shadow, whose rank is chosen per step
    device: int  # devices 0..dp-1 hold the ranks; higher ones are spare and healthy
    attempt: int  # added to the step's attempt number (1 for a re-execution)
    replica: int = 0  # 0 for the rank's own device, j for its j-th copy elsewhere


def parse_detectors(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return DETECTORS
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for i, name in enumerate(names):
        if name == "all":
            raise ConfigError("detect.detectors: all names every detector, so it stands alone; "
                              "write all, or a comma-separated list of "
                              f"{', '.join(DETECTORS)}.")
        if name not in DETECTORS:
            raise ConfigError(f"detect.detectors names {name!r}, which is not one of "
                              f"{', '.join(DETECTORS)}, or all"
                              f"{did_you_mean(name.lower(), DETECTORS + ('all',))}.")
        if name in names[:i]:  # a second copy would compare again, listed twice in detections
            raise ConfigError(f"detect.detectors names {name!r} twice; name each detector "
                              f"once.")
    if not names:
        raise ConfigError("detect.detectors is empty; name at least one of "
                          f"{', '.join(DETECTORS)}, or all.")
    return names


def needs_reference(detectors: tuple[str, ...], advance: str) -> bool:
    """The lock-step mirror also gives the ground truth and the clean gradient."""
    return "lockstep" in detectors or "localize" in detectors or advance == "reference"


def executions(detectors: tuple[str, ...], dp: int, replicas: int = 3,
               advance: str = "primary") -> list[Execution]:
    out = [Execution("primary", d, d, 0) for d in range(dp)]
    if "reexec" in detectors:
        out += [Execution("reexec", d, d, 1) for d in range(dp)]
    if "shadow" in detectors:
        out.append(Execution("shadow", -1, dp, 0))
    copies = replicas - 1 if "localize" in detectors else \
        1 if needs_reference(detectors, advance) else 0
    for j in range(1, copies + 1):
        out += [Execution("replica", d, dp + 1 + (j - 1) * dp + d, 0, j) for d in range(dp)]
    return out


def validate(cfg) -> None:
    d, dp = cfg.detect, cfg.mesh.dp
    parse_detectors(d.detectors)
    if cfg.mesh.tp != 1:
        raise ConfigError("experiment.mode detect runs data-parallel only; set mesh.tp=1.")
    if not 0 <= d.suspect_rank < dp:
        raise ConfigError(f"detect.suspect_rank ({d.suspect_rank}) must name a rank below "
                          f"mesh.dp ({dp}).")
    if not -1 <= d.shadow_rank < dp:
        raise ConfigError(f"detect.shadow_rank ({d.shadow_rank}) must be -1 (round robin) or a "
                          f"rank below mesh.dp ({dp}).")
    if d.replicas < 3:
        raise ConfigError(f"detect.replicas must be at least 3 to name a faulty rank (a pair "
                          f"can only detect), not {d.replicas}.")
    if d.advance not in ADVANCE:
        raise ConfigError(f"detect.advance {d.advance!r} is not one of {', '.join(ADVANCE)}.")
    if d.rollback and d.advance != "primary":
        raise ConfigError("detect.rollback re-runs steps trained on what the ranks computed; "
                          "set detect.advance=primary with it.")
    if cfg.abft.enabled and "abft" not in parse_detectors(d.detectors):
        # The detect step checks its matmuls only as the abft detector: left alone, the key
        # would be ignored and the run would read as one with ABFT.
        raise ConfigError("experiment.mode detect runs ABFT only as its abft detector; add "
                          "abft to detect.detectors, or set abft.enabled false.")
    if d.spike_window < 1 or d.max_retries < 0:
        raise ConfigError("detect.spike_window must be at least 1 and detect.max_retries at "
                          "least 0.")
