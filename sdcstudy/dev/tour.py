"""`python -m sdcstudy.dev.tour [--check]`: README's tour output, written by the code it shows.

README.md holds what `sdcstudy demo` prints between the markers `BEGIN` and `END`. This tool
runs the demo once in a subprocess (the command a newcomer types, with its 40 steps and its
paper-node-1 suspect), keeps its stdout, shows the temporary run folder as `runs/demo`, and
rewrites the block (`make tour`); with `--check` it rewrites nothing and exits 1 when README
differs. One run costs a few minutes on two CPU cores, so the test suite does not run it:
tests/test_demo.py compares README's block with its own short demo run through `skeleton`,
which masks what a shorter run with another profile prints differently (the numbers, the
profile, the run folder) and keeps the words and columns.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- tour:demo:begin -->"
END = "<!-- tour:demo:end -->"
SHOWN_OUT = "runs/demo"  # where README says the demo's folders are
COMMAND = f"$ sdcstudy demo --out {SHOWN_OUT}"
PROFILE = "paper-node-1"  # sdcstudy.demo.PROFILE (kept here so this module needs no JAX)

_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_PUBLISHED_WCNTS = re.compile(r" \(Ma et al\., Figure 5: [^)]*\)")
_EMPTY_CELL = re.compile(r"\| -(?= \|)")


def run_demo() -> str:
    """What `sdcstudy demo` prints on stdout, its run folder shown as `SHOWN_OUT`."""
    with tempfile.TemporaryDirectory(prefix="sdcstudy-tour-") as tmp:
        out = Path(tmp) / "demo"
        proc = subprocess.run([sys.executable, "-m", "sdcstudy", "demo", "--out", str(out),
                               "--no-progress"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"sdcstudy demo exited {proc.returncode}: "
                             f"{proc.stderr.strip().splitlines()[-1:]}")
        return proc.stdout.replace(str(out), SHOWN_OUT)


def block(demo_output: str) -> str:
    """The text between the markers: the command and what it printed, as a code block."""
    return f"\n```\n{COMMAND}\n{demo_output.strip()}\n```\n"


def shown_block(readme_text: str) -> str:
    """The text between README's markers; a README without them is an error."""
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1:
        raise ValueError(f"README.md must hold {BEGIN} and {END} once each")
    return readme_text.split(BEGIN, 1)[1].split(END, 1)[0]


def shown_output(readme_text: str) -> str:
    """What README says the demo printed: its block less the fence and the command line."""
    lines = shown_block(readme_text).strip().splitlines()
    if len(lines) < 3 or lines[0] != "```" or lines[1] != COMMAND or lines[-1] != "```":
        raise ValueError(f"README.md's tour block is not a code block starting '{COMMAND}'; "
                         f"rewrite it with: make tour")
    return "\n".join(lines[2:-1])


def with_block(readme_text: str, demo_output: str) -> str:
    head, rest = readme_text.split(BEGIN, 1)
    return head + BEGIN + block(demo_output) + END + rest.split(END, 1)[1]


def skeleton(demo_output: str, profile: str, out: str) -> str:
    """The demo's output with what depends on the run's length and profile masked: numbers
    become '#', empty cells and bit counts '#', the profile 'PROFILE', the run folder 'OUT',
    and the published WCNTS (printed for paper nodes only) is dropped."""
    text = demo_output.strip().replace(out, "OUT").replace(profile, "PROFILE")
    text = _PUBLISHED_WCNTS.sub("", text)
    text = _NUMBER.sub("#", text)
    text = text.replace("# / # / #", "#")
    return _EMPTY_CELL.sub("| #", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdcstudy.dev.tour",
                                     description="run the demo and rewrite README's tour block")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 if README's block differs")
    args = parser.parse_args(argv)
    shown_block(README.read_text())  # refuse a README without markers before the long run
    output = run_demo()
    text = README.read_text()  # again: someone may have edited it during the run
    new = with_block(text, output)
    if args.check:
        if new != text:
            print("README.md's tour block differs from what `sdcstudy demo` prints; rewrite it "
                  "with: make tour", file=sys.stderr)
            return 1
        print("README.md's tour block is what `sdcstudy demo` prints")
        return 0
    README.write_text(new)
    print("README.md's tour block rewritten from a fresh `sdcstudy demo` run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
