"""A plan (`summary.make_plan`) as the text `sdcstudy plan` prints. No JAX."""

from __future__ import annotations

BACKENDS = {"cpu": "simulated CPU devices", "gpu": "GPUs", "tpu": "TPUs"}


def _digits(x: float, digits: int) -> str:
    """`x` to `digits` significant digits, never in exponent notation (Python's `g` writes
    1023.7 as 1.02e+03): a value past them is written whole, with thousands separators."""
    text = f"{x:.{digits}g}"
    return f"{x:,.0f}" if "e" in text else text


def _scaled(n: float, units, digits: int) -> str:
    """`n` in the largest of `units` ((name, scale), largest first) where it prints as at least
    1, so 0.9996 s is 1 s (not 1e+03 ms) and 1023.7 KiB is 1 MiB; the last unit takes the rest."""
    for unit, scale in units[:-1]:
        if float(_digits(n / scale, digits).replace(",", "")) >= 1:
            return f"{_digits(n / scale, digits)}{unit}"
    unit, scale = units[-1]
    return f"{_digits(n / scale, digits)}{unit}"


def size(n: float) -> str:
    """Bytes in binary units: 512 B, 3.25 MiB, 14.7 GiB, 1,010 MiB."""
    return _scaled(n, ((" TiB", 2 ** 40), (" GiB", 2 ** 30), (" MiB", 2 ** 20), (" KiB", 2 ** 10),
                       (" B", 1)), 3)


def flop(n: float) -> str:
    return _scaled(n, ((" PFLOP", 1e15), (" TFLOP", 1e12), (" GFLOP", 1e9), (" MFLOP", 1e6),
                       (" FLOP", 1.0)), 4)


def count(n: int) -> str:
    return _scaled(n, (("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1)), 3)


def seconds(t: float) -> str:
    return _scaled(t, ((" s", 1.0), (" ms", 1e-3), (" us", 1e-6), (" ns", 1e-9)), 3)


def _rows(rows: list[tuple[str, str, str]]) -> list[str]:
    width = max(len(r[0]) for r in rows)
    return [f"  {a:<{width}}  {b:>10}  {c}".rstrip() for a, b, c in rows]


def header(plan: dict) -> list[str]:
    m, s, c = plan["mesh"], plan["step"], plan["compiled_for"]
    devices = m["node"] * m["dp"] * m["tp"]
    return [
        f"plan of {plan['config']}: {plan['mode']}, {plan['preset']} "
        f"({count(plan['n_params'])} parameters), {plan['dtype']} "
        f"(parameters in {plan['param_dtype']})",
        f"mesh: node {m['node']} x dp {m['dp']} x tp {m['tp']} = {devices} devices; a step: "
        f"{s['microsteps']} microsteps x {s['batch_size']} sequences x {s['seq_len']} tokens "
        f"= {plan['tokens_per_node']:,} tokens a node",
        f"compiled for {c['devices']} {BACKENDS.get(c['backend'], c['backend'])}"
        f"{'' if c['backend'] == 'cpu' else ' (' + c['device_kind'] + ')'} in "
        f"{c['compile_s']:.1f} s",
    ]


def memory(plan: dict) -> list[str]:
    st, mem = plan["state"], plan["memory"]
    rows = [("parameters", size(st["params"]), "the state's shardings"),
            ("optimizer state", size(st["opt_state"]), "the state's shardings")]
    if mem:
        backend = plan["compiled_for"]["backend"]
        rows += [("arguments", size(mem["argument"]), f"XLA memory analysis ({backend}): "
                                                      f"state and batch"),
                 ("outputs", size(mem["output"]), "state, metrics, tables"),
                 ("donated", size(mem["alias"]), "outputs written over arguments"),
                 ("temporaries", size(mem["temp"]), "activations, gradients, buffers"),
                 ("needs in all", size(mem["total"]), "arguments + outputs - donated + "
                                                        "temporaries + code")]
    return ["per device:"] + _rows(rows)


def flops(plan: dict) -> list[str]:
    f, m = plan["flops"], plan["mesh"]
    line = (f"FLOPs a step: {flop(f['node'])} a node (bench/roofline.py), "
            f"{flop(f['device'])} a device (/ dp {m['dp']} x tp {m['tp']})")
    if f["xla_device"] is not None:
        line += f"; XLA's cost analysis: {flop(f['xla_device'])} a device"
        if plan["step"]["microsteps"] > 1:
            line += " (it counts the microstep loop's body once)"
    return [line]


def crossing(plan: dict) -> list[str]:
    parts = plan["node_bytes"]
    if not parts:
        return ["sent between nodes: nothing (one node)"]
    m = plan["mesh"]
    pairs = m["dp"] * m["tp"]
    rows = [(what, size(n), "") for what, n in parts.items()]
    total = plan["node_bytes_total"]
    rows.append(("total", size(total), f"x {pairs} device pairs, each way: "
                                       f"{size(total * pairs)} a step"))
    return ["sent to the other node, per device and step (it receives as much):"] + _rows(rows)


def device_table(plan: dict) -> list[str]:
    lines = [f"{'device':<7} {'memory':>10} {'needs':>10} {'step time':>10}  fits"]
    for row in plan["devices"]:
        fits = "?"
        if "fits" in row:
            fits = f"{'yes' if row['fits'] else 'no'} ({row['share']:.0%} of its memory)"
            if row["mem_fraction"] is not None:
                fits += f" with XLA_PYTHON_CLIENT_MEM_FRACTION={row['mem_fraction']:.2f}"
        need = size(row["need"]) if "need" in row else "?"
        lines.append(f"{row['device']:<7} {size(row['memory']):>10} {need:>10} "
                     f"{seconds(row['seconds']):>10}  {fits}")
    first = plan["devices"][0]
    lines.append(f"step time = FLOPs a device / (MFU x peak): {first['mfu_source']}; "
                 f"{first['peak']}")
    return lines


def render(plan: dict) -> str:
    blocks = [header(plan), memory(plan), flops(plan), crossing(plan), device_table(plan)]
    return "\n\n".join("\n".join(b) for b in blocks)
