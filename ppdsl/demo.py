"""`make demo`: compile examples/zb_v.pp (d=4, m=8) and train tiny_gpt (its
128-token variant) on a 4-process CPU pipeline (gloo on loopback), printing loss
per step and the predicted-vs-measured memory table."""

from __future__ import annotations

import sys
from pathlib import Path

from ppdsl.compiler import compile_file
from ppdsl.diagnostics import CompileError, render_all

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from ppdsl.commands.common import ExitCode
    from ppdsl.commands.run import launch

    example = ROOT / "examples" / "zb_v.pp"
    model = ROOT / "examples" / "models" / "tiny_gpt.py"
    steps = (argv or [])[:1] or ["20"]
    print("ppdsl demo: examples/zb_v.pp -D d=4 -D m=8, tiny_gpt, 4 CPU ranks", flush=True)
    try:
        compiled = compile_file(example, {"d": "4", "m": "8"})
    except CompileError as err:
        print(render_all(err.diagnostics, sys.stderr), file=sys.stderr)
        return ExitCode.INVALID
    # stages_long: 128-token sequences with unfused attention, the zero-bubble paper's
    # memory regime (B frees most of a microbatch's activations).
    return launch(
        compiled, ["--model", f"{model}:stages_long", "--steps", steps[0], "--device", "cpu"]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
