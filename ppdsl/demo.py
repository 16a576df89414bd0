"""`make demo`: compile examples/zb_v.pp (d=4, m=8) and train tiny_gpt on a
4-process CPU pipeline (gloo on loopback), printing loss per step and the
predicted-vs-measured memory table."""

from __future__ import annotations

import sys
from pathlib import Path

from ppdsl.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    example = ROOT / "examples" / "zb_v.pp"
    model = ROOT / "examples" / "models" / "tiny_gpt.py"
    steps = (argv or [])[:1] or ["20"]
    print(f"ppdsl demo: {example.relative_to(ROOT)} -D d=4 -D m=8, tiny_gpt, 4 CPU ranks", flush=True)
    return cli_main([
        "run", str(example), "-D", "d=4", "-D", "m=8",
        "--model", f"{model}:stages", "--steps", steps[0], "--device", "cpu",
    ])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
