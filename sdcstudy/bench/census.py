"""The kernel census of a compiled step, read from its optimized HLO text.

Which library runs each matrix product (cuBLAS, cuBLASLt, a Triton GEMM fusion, a cuDNN
fusion, or XLA's own emitter, as on a CPU) and its model FLOPs; the tile sizes XLA gave each
Triton GEMM; cuDNN's fused attention and the Pallas flash-attention kernels (by kernel
name); what became of each scatter (kept as a scatter, turned into a serial `while` loop by
XLA's scatter expander, or sorted by its determinism expander); and how many fusions the
step launches. On a GPU this tells an untuned kernel choice from a tuned one
(`xla_gpu_deterministic_ops` turns autotuning off, so every Triton GEMM keeps one default
tile) and a serialized scatter from a fast one, before anyone profiles.

Pure text parsing, no JAX: it reads `compiled.as_text()` (`StepRunner.hlo`) as XLA prints it
on any platform. The counts are static: an operation inside a loop body counts once. Fusions
and custom calls count where they launch (the entry computation and the loops, conditionals
and calls it runs), never inside another fusion; scatters and sorts count wherever they are.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

# `ENTRY %main.1 (p: f32[2]) -> f32[2] {` or `fused_computation {`: a computation begins.
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
# `  ROOT %name = TYPE opcode(rest`, TYPE an array shape or a tuple of them.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
# A Triton kernel's name in its backend config: `name = "mha_forward"` or `"name":"..."`.
_KERNEL_NAME = re.compile(r'\bname\\?"?\s*[=:]\s*\\?"([\w.\-]+)')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")

TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas (Triton) kernel's custom call
# core/model.py pallas_attention's kernels (JAX's Pallas flash attention), by kernel name.
PALLAS_ATTENTION = {"mha_forward": "pallas_forward", "mha_backward": "pallas_backward"}
TRITON_KIND = "__triton"  # __triton_gemm, __triton_nested_gemm_fusion and later spellings
CUDNN_FUSION_KIND = "__cudnn$fusion"
BACKENDS = ("cublas", "cublaslt", "triton", "cudnn", "xla")
TILE_KEYS = ("block_m", "block_n", "block_k", "split_k", "num_stages", "num_warps")


@dataclass(frozen=True)
class Op:
    """One HLO instruction: its name, result type, opcode, operands as (name, inline type)
    and the attributes after the operand list."""
    name: str
    shape: str
    opcode: str
    operands: tuple[tuple[str, str], ...]
    attrs: str

    def config(self, key: str) -> str | None:
        """A scalar field of the backend config (JSON, quoted or not): `"block_m":"64"`."""
        m = re.search(rf'\\?"{key}\\?"\s*:\s*\\?"?([^",}}\\\]]+)', self.attrs)
        return m.group(1).strip() if m else None

    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""

    def called(self, attribute: str = "calls") -> str | None:
        m = re.search(rf"\b{attribute}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


def _split_call(rest: str) -> tuple[str, str]:
    """(operand list, attributes) of the text after `opcode(`."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return rest[:i], rest[i + 1:]
            depth -= 1
    return rest, ""


def _operands(text: str) -> tuple[tuple[str, str], ...]:
    """Operands split at top-level commas: (name, its type when printed inline, else '')."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    out = []
    for part in filter(None, parts):
        head, _, name = part.rpartition(" ")
        out.append((name.lstrip("%"), head.strip()))
    return tuple(out)


def parse(text: str) -> dict[str, list[Op]]:
    """Each computation of an HLO module and its instructions, in order."""
    comps: dict[str, list[Op]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = comps.setdefault(header.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, opcode, rest = m.groups()
            operands, attrs = _split_call(rest)
            current.append(Op(name, shape, opcode, _operands(operands), attrs))
    return comps


def _dims(shape: str) -> list[int]:
    """The dimensions of a type's first array (a tuple's first element)."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _ints(text: str | None) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


def _gemm_flops(op: Op, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size, for a `dot` or a library GEMM custom call."""
    m = _CONTRACTING.search(op.attrs)
    if m is None:
        m = re.search(r'lhs_contracting_dimensions\\?"\s*:\s*\[([^\]]*)\]', op.attrs)
    if m is None or not op.operands:
        return 0.0
    lhs_name, lhs_inline = op.operands[0]
    lhs = _dims(shapes.get(lhs_name) or lhs_inline)
    contracted = math.prod(lhs[d] for d in _ints(m.group(1)) if d < len(lhs))
    return 2.0 * math.prod(_dims(op.shape)) * contracted


class _Module:
    """The parsed module: computations, each one's types by name, and which are fused."""

    def __init__(self, text: str):
        self.comps = parse(text)
        self.shapes = {c: {op.name: op.shape for op in ops} for c, ops in self.comps.items()}
        self.fused = {op.called() for ops in self.comps.values() for op in ops
                      if op.opcode == "fusion"} - {None}

    def launched(self):
        """(computation, op) for every instruction outside fused computations."""
        for comp, ops in self.comps.items():
            if comp not in self.fused:
                for op in ops:
                    yield comp, op

    def everywhere(self):
        for comp, ops in self.comps.items():
            for op in ops:
                yield comp, op

    def dots_in(self, comp: str | None, seen: frozenset = frozenset()) -> list[tuple[str, Op]]:
        """The dots of a fused computation and of the fusions nested in it."""
        if comp is None or comp in seen or comp not in self.comps:
            return []
        out = []
        for op in self.comps[comp]:
            if op.opcode == "dot":
                out.append((comp, op))
            elif op.opcode == "fusion":
                out += self.dots_in(op.called(), seen | {comp})
        return out

    def triton_tile(self, op: Op) -> dict:
        """A Triton GEMM fusion's tile: from `triton_gemm_config`, or for a nested GEMM
        fusion from its output tile (block_m x block_n) and its lhs operand's tile (block_k)."""
        tile = {key: int(v) for key in TILE_KEYS if (v := op.config(key)) is not None
                and v.isdigit()}
        sizes = _ints(self._output_tiles(op))
        if "block_m" not in tile and len(sizes) >= 2:
            tile["block_m"], tile["block_n"] = sizes[-2], sizes[-1]
            block_k = self._nested_block_k(op.called())
            if block_k is not None:
                tile["block_k"] = block_k
        return tile

    @staticmethod
    def _output_tiles(op: Op) -> str | None:
        m = re.search(r'output_tiles\\?"\s*:\s*\[\s*\{\s*\\?"sizes\\?"\s*:\s*\[([^\]]*)\]',
                      op.attrs)
        return m.group(1) if m else None

    def _nested_block_k(self, comp: str | None) -> int | None:
        ops = {op.name: op for op in self.comps.get(comp, [])}
        dot = next((op for op in ops.values() if op.opcode == "dot"), None)
        if dot is None or not dot.operands:
            return None
        lhs = ops.get(dot.operands[0][0])
        m = _CONTRACTING.search(dot.attrs)
        contracting = _ints(m.group(1) if m else None)
        sizes = _ints(self._output_tiles(lhs)) if lhs is not None else []
        if not contracting or contracting[0] >= len(sizes):
            return None
        return sizes[contracting[0]]


def _target(op: Op) -> str:
    m = _TARGET.search(op.attrs)
    return m.group(1) if m else ""


def _library_gemm(op: Op) -> str | None:
    """"cublas" or "cublaslt" for a cuBLAS GEMM custom call, else None."""
    target = _target(op)
    if not target.startswith("__cublas"):
        return None
    return "cublaslt" if "$lt$" in target else "cublas"


def _fusion_backend(op: Op) -> str:
    """The library of a fusion that holds a dot: Triton, cuDNN, or XLA's own emitter."""
    kind = op.config("kind") or ""
    if kind.startswith(TRITON_KIND):
        return "triton"
    return "cudnn" if kind == CUDNN_FUSION_KIND else "xla"


class _Tally:
    """What `census` counts while it walks the launched instructions."""

    def __init__(self, module: _Module):
        self.module = module
        self.gemms = Counter(dict.fromkeys(BACKENDS, 0))
        self.gflop = Counter(dict.fromkeys(BACKENDS, 0.0))
        self.tiles, self.kinds, self.targets, self.loops = Counter(), Counter(), Counter(), []
        self.attention = {"cudnn_fmha_forward": 0, "cudnn_fmha_backward": 0,
                          **dict.fromkeys(PALLAS_ATTENTION.values(), 0)}

    def gemm(self, backend: str, flops: float) -> None:
        self.gemms[backend] += 1
        self.gflop[backend] += flops / 1e9

    def fusion(self, op: Op) -> None:
        self.kinds[op.config("kind") or _fusion_kind(op)] += 1
        dots = self.module.dots_in(op.called())
        if dots:
            backend = _fusion_backend(op)
            self.gemm(backend, sum(_gemm_flops(d, self.module.shapes[c]) for c, d in dots))
            if backend == "triton":
                self.tiles[tuple(sorted(self.module.triton_tile(op).items()))] += 1

    def custom_call(self, op: Op, shapes: dict[str, str]) -> None:
        target = _target(op)
        self.targets[target] += 1
        if (library := _library_gemm(op)) is not None:
            self.gemm(library, _gemm_flops(op, shapes))
        elif target.startswith("__cudnn$fmha"):
            direction = "backward" if "Backward" in target else "forward"
            self.attention[f"cudnn_fmha_{direction}"] += 1
        elif target == TRITON_CALL and (m := _KERNEL_NAME.search(op.attrs)):
            if m.group(1) in PALLAS_ATTENTION:
                self.attention[PALLAS_ATTENTION[m.group(1)]] += 1

    def loop(self, op: Op) -> None:
        m = _TRIP_COUNT.search(op.attrs)
        self.loops.append({"name": op.name, "trip_count": int(m.group(1)) if m else None,
                           "op_name": op.op_name()})


def census(text: str) -> dict:
    """The kernel census of one optimized HLO module (see the module docstring)."""
    module = _Module(text)
    tally = _Tally(module)
    for comp, op in module.launched():
        if op.opcode == "fusion":
            tally.fusion(op)
        elif op.opcode == "custom-call":
            tally.custom_call(op, module.shapes[comp])
        elif op.opcode == "dot":
            tally.gemm("xla", _gemm_flops(op, module.shapes[comp]))
        elif op.opcode == "while":
            tally.loop(op)
    return {"gemms": dict(tally.gemms), "gemm_gflop": dict(tally.gflop),
            "triton_tiles": [{**dict(key), "count": n} for key, n in tally.tiles.most_common()],
            "attention": tally.attention,
            "cudnn_fusions": tally.kinds[CUDNN_FUSION_KIND],
            "scatters": _scatters(module, tally.loops),
            "fusions": sum(tally.kinds.values()), "fusion_kinds": dict(tally.kinds),
            "custom_calls": dict(tally.targets), "while_loops": tally.loops}


def _fusion_kind(op: Op) -> str:
    m = re.search(r"\bkind=(k\w+)", op.attrs)
    return m.group(1) if m else "unknown"


def _scatters(module: _Module, loops: list[dict]) -> dict:
    """Scatters kept as scatters, scatters XLA turned into serial `while` loops, and sorts a
    scatter left behind (each loop and sort keeps the op_name of the scatter it came from)."""
    ops = [op for _, op in module.everywhere()]
    return {"native": sum(op.opcode == "scatter" for op in ops),
            "while_loops": sum("scatter" in loop["op_name"] for loop in loops),
            "sort_based": sum(op.opcode == "sort" and "scatter" in op.op_name() for op in ops)}


def describe(c: dict) -> str:
    """The census in one line, for a table."""
    g = c["gemms"]
    names = {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "triton": "Triton", "cudnn": "cuDNN",
             "xla": "XLA"}
    gemms = ", ".join(f"{names[b]} {g[b]} ({c['gemm_gflop'][b]:.4g} GFLOP)" for b in BACKENDS
                      if g[b])
    tiles = "; ".join(f"{t.get('block_m')}x{t.get('block_n')}x{t.get('block_k')} split_k "
                      f"{t.get('split_k', '-')} stages {t.get('num_stages')} warps "
                      f"{t.get('num_warps')}: {t['count']}" for t in c["triton_tiles"][:4])
    s = c["scatters"]
    a = c["attention"]
    return (f"GEMMs {sum(g.values())}: {gemms or 'none'}"
            + (f"; Triton tiles {tiles}" if tiles else "")
            + f"; cuDNN attention {a['cudnn_fmha_forward']} forward, "
              f"{a['cudnn_fmha_backward']} backward"
            + (f"; Pallas attention {a['pallas_forward']} forward, {a['pallas_backward']} "
               f"backward" if a.get("pallas_forward") or a.get("pallas_backward") else "")
            + f"; scatters {s['native']} kept, "
              f"{s['while_loops']} as while loops, {s['sort_based']} sorted; "
              f"{c['fusions']} fusions")
