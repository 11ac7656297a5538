"""`sdcstudy fleet`: what silent data corruption costs a training job at fleet scale.

- `config`: the defaults (configs/fleet.yaml holds the same values, with their sources), YAML
  files and `--set key=value` overrides, checked into one `FleetConfig`;
- `strategies`: the detectors (none, monitor, abft, shadow, reexec, lockstep) and their
  combinations, and overheads read from a `sdcstudy bench detect --json` file;
- `model`: the analytic expectation of goodput, corrupted steps and rollback loss;
- `montecarlo`: the same model drawn event by event with a seeded numpy Generator;
- `plot`: goodput against fleet size; `cli`: `sdcstudy fleet simulate`.

docs/fleet.md derives the equations and every default. Imports no JAX.
"""
