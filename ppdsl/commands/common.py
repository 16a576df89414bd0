"""What several subcommands share: exit codes, the usage error, the schedule
file argument and `-D` overrides."""

from __future__ import annotations

import argparse
import os
import re
from enum import IntEnum
from pathlib import Path

from ppdsl import limits
from ppdsl.analysis.device_bytes import DeviceOptions
from ppdsl.compiler import Compiled, compile_file
from ppdsl.costs_file import CostsFile, load_costs_file
from ppdsl.runtime.choices import OPTIMIZERS, PRECISIONS
from ppdsl.semantics import DP_MODES
from ppdsl.topology import Topology, load_topology

__all__ = [
    "add_lengths_arguments",
    "lengths_from_args",
    "with_lengths",
    "ExitCode",
    "UsageError",
    "add_schedule_arguments",
    "add_defines_argument",
    "add_costs_from_argument",
    "add_limit_arguments",
    "limits_from_args",
    "output_file",
    "check_model_file",
    "output_directory",
    "write_output",
    "parse_defines",
    "compile_from_args",
    "costs_from_args",
]


class ExitCode(IntEnum):
    """What `ppdsl` exits with; every command returns one (or raises, and the
    CLI maps the exception to one)."""

    OK = 0
    """Done; the schedule is valid."""
    INVALID = 1
    """Invalid input (a located diagnostic was printed), or the work it asked for
    failed (the ranks of `ppdsl run`)."""
    USAGE = 2
    """Bad command-line use (argparse's, or a `UsageError`)."""
    INTERNAL = 3
    """A bug in ppdsl (the traceback was printed)."""
    INTERRUPTED = 130
    """Stopped with Ctrl-C."""


class UsageError(Exception):
    """Bad command-line use that argparse cannot see: the CLI prints
    `ppdsl COMMAND: error: ...` and exits `ExitCode.USAGE`."""


def add_schedule_arguments(parser: argparse.ArgumentParser, *, optional_file: bool = False) -> None:
    """FILE (left out where `optional_file`: the command checks its own), repeated
    `-D name=value` and `--costs-from`."""
    if optional_file:
        parser.add_argument("file", metavar="FILE", nargs="?", default=None,
                            help="the .pp schedule file")
    else:
        parser.add_argument("file", metavar="FILE", help="the .pp schedule file")
    add_defines_argument(parser, "override a parameter's default")
    add_costs_from_argument(parser)
    add_limit_arguments(parser)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """`--max-source-bytes`, `--max-depth`, ... (`ppdsl.limits`; read by
    `limits_from_args`, which the CLI applies to the whole command)."""
    group = parser.add_argument_group(
        "limits", "what the compiler refuses before starting work (docs/language.md)"
    )
    for field, flag in limits.FLAGS.items():
        default = getattr(limits.DEFAULT, field)
        group.add_argument(
            flag, metavar="N", default=None, dest=f"max_{field}",
            help=f"default {default:,}",
        )


def limits_from_args(args: argparse.Namespace) -> limits.Limits:
    """The `--max-*` flags given (each a positive integer), over the defaults."""
    given = {}
    for field, flag in limits.FLAGS.items():
        text = getattr(args, f"max_{field}", None)
        if text is None:
            continue
        try:
            value = int(str(text).replace("_", "").replace(",", ""))
        except ValueError:
            raise UsageError(f"{flag} {text!r}: expected a positive integer") from None
        if value < 1:
            raise UsageError(f"{flag} {text}: expected a positive integer")
        given[field] = value
    return limits.Limits(**given)


def check_model_file(spec: str) -> None:
    """`--model FILE.py:FACTORY` names a file that exists (a UsageError otherwise,
    before any work); `MODULE:FACTORY` is left to the import."""
    target = spec.rpartition(":")[0]
    if (target.endswith(".py") or "/" in target) and not Path(target).is_file():
        raise UsageError(f"--model {spec}: no such file '{target}'")


def output_file(path: str) -> Path:
    """An output file the command may write: its folder exists and is a folder,
    and the path itself is no folder; otherwise a UsageError (checked before
    compiling, so the mistake is reported at once)."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"'{path}' is a directory; give a file name")
    parent = out.parent
    if not parent.exists():
        raise UsageError(f"cannot write '{path}': no directory '{parent}'")
    if not parent.is_dir():
        raise UsageError(f"cannot write '{path}': '{parent}' is not a directory")
    writable = os.access(out, os.W_OK) if out.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise UsageError(f"cannot write '{path}': permission denied")
    return out


def write_output(path: str | Path, text: str, *, newline: str | None = None) -> None:
    """Write `text` to `path`; an OSError (a full disk, no permission) is a UsageError."""
    try:
        with Path(path).open("w", encoding="utf-8", newline=newline) as out:
            out.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write '{path}': {exc.strerror or exc}") from None


def output_directory(path: str | Path) -> Path:
    """An output folder the command may create or fill: not an existing file,
    under a folder (or an ancestor) that can be written; otherwise a UsageError."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"'{out}' exists and is not a directory; give a directory for the output")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"cannot create '{out}': '{probe}' is a file, not a directory")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write in '{probe}': permission denied")
    return out


def add_dp_arguments(parser: argparse.ArgumentParser) -> None:
    """`--dp N` and `--dp-mode replicate|shard` (data parallel x pipeline)."""
    parser.add_argument(
        "--dp", type=int, default=1, metavar="N",
        help="data-parallel replicas of the pipeline (world = N x pipeline ranks; global "
        "rank = replica * pipeline ranks + pipeline rank; default 1)",
    )
    parser.add_argument(
        "--dp-mode", choices=DP_MODES, default="replicate",
        help="replicate (default): all-reduce each stage's gradients after its last W; "
        "shard: FSDP2 per stage, gathered once per step, reduce-scattered after its last W",
    )


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
                "gib": 2**30}


def parse_bytes(text: str) -> int:
    """`512MiB`, `2GiB`, `800MB`, `1000000` -> bytes (a UsageError otherwise)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in _BYTE_UNITS:
        raise UsageError(f"--memory {text!r}: give bytes, or a number with KiB, MiB, GiB, KB, "
                         "MB or GB (e.g. 512MiB)")
    value = int(float(found.group(1)) * _BYTE_UNITS[found.group(2).lower()])
    if value <= 0:
        raise UsageError(f"--memory {text!r}: need a positive budget")
    return value


def add_bytes_arguments(parser: argparse.ArgumentParser, *, dp: bool = False) -> None:
    """`--param-dtype`, `--optimizer`, `--precision` (as `ppdsl run` spells them):
    how the whole-device byte model holds the model state (`device_options`)."""
    parser.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="parameter (and gradient) dtype (default fp32)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                        help="optimizer whose state is counted (default adam: 2 fp32 moments; "
                        "sgd: none; over bf16 parameters an fp32 master copy too)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="autocast precision (default fp32: none); over fp32 parameters "
                        "it keeps a low-precision weight copy per stage")
    if dp:
        add_dp_arguments(parser)


def device_options(args: argparse.Namespace) -> DeviceOptions:
    """The `analysis.device_bytes.DeviceOptions` of `add_bytes_arguments`' flags
    and `--dp`/`--dp-mode`."""
    return DeviceOptions(param_dtype=args.param_dtype, optimizer=args.optimizer,
                         precision=args.precision, dp=getattr(args, "dp", 1),
                         dp_mode=getattr(args, "dp_mode", "replicate"))


def check_dp_arguments(args: argparse.Namespace) -> None:
    """A usage error for a bad `--dp`."""
    if args.dp < 1:
        raise UsageError(f"--dp must be at least 1, not {args.dp}")


def add_costs_from_argument(parser: argparse.ArgumentParser) -> None:
    """`--costs-from COSTS.pp` (read by `costs_from_args`)."""
    parser.add_argument(
        "--costs-from", metavar="COSTS.pp", default=None,
        help="take the costs and memory model from this file (what `ppdsl profile -o` "
        "writes) instead of the schedule's own; the schedule's expectations become warnings",
    )


def add_defines_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """Repeated `-D name=value` (parsed by `parse_defines`)."""
    parser.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"{what} (repeatable), e.g. -D d=8 -D m=32",
    )


def parse_defines(defines: list[str]) -> dict[str, str]:
    """`["d=8", "m=32"]` -> `{"d": "8", "m": "32"}`; a malformed one is a
    UsageError (exit 2). Whether the value suits the param is the file's to say."""
    found: dict[str, str] = {}
    errors: list[str] = []
    for item in defines:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            errors.append(f"-D {item!r}: expected NAME=VALUE, e.g. -D d=8")
        elif not name.isidentifier():
            errors.append(f"-D {item!r}: {name!r} is not a param name")
        elif any(ch in value for ch in "\n\r;"):
            errors.append(f"-D {item!r}: the value must be one expression on one line")
        elif name in found:
            errors.append(f"-D {name} given twice ({found[name]!r} and {value!r})")
        else:
            found[name] = value
    if errors:
        raise UsageError("; ".join(errors))
    return found


def costs_from_args(args: argparse.Namespace) -> CostsFile | None:
    """The `--costs-from` file, parsed (None without the option)."""
    path = getattr(args, "costs_from", None)
    return load_costs_file(path) if path else None


def add_lengths_arguments(parser: argparse.ArgumentParser) -> None:
    """`--lengths`, `--lengths-from` (with `--max-seq-len`, `--pack`, `--step`):
    one step's microbatch lengths, for costs and memory in tokens
    (docs/language.md, "Costs in tokens")."""
    group = parser.add_argument_group("a step's microbatch lengths (costs in tokens)")
    group.add_argument("--lengths", metavar="N,N,...", default=None,
                       help="each microbatch's tokens, in order (one per microbatch)")
    group.add_argument("--lengths-from", metavar="FILE", default=None,
                       help="one length per line, or a .npz document file (tokens, offsets) "
                       "cut as `ppdsl run --data` cuts it (ppdsl/lengths.py)")
    group.add_argument("--max-seq-len", type=int, default=None, metavar="L",
                       help="with a document file: microbatch j is a document cut to L tokens")
    group.add_argument("--pack", type=int, default=None, metavar="T",
                       help="with a document file: documents packed greedily to <= T tokens")
    group.add_argument("--step", type=int, default=0, metavar="K",
                       help="with a document file: the lengths of step K (default 0)")


def lengths_from_args(args: argparse.Namespace, num_microbatches: int) -> list[int] | None:
    """The step's lengths the command line gives (None: none given). Raises
    UsageError for a malformed list or file, or a count that is not the
    schedule's microbatches."""
    from ppdsl import lengths as documents

    given, path = getattr(args, "lengths", None), getattr(args, "lengths_from", None)
    cutting = args.max_seq_len is not None or args.pack is not None or args.step != 0
    if given is not None and path is not None:
        raise UsageError("give --lengths or --lengths-from, not both")
    if cutting and (path is None or not str(path).endswith(".npz")):
        raise UsageError("--max-seq-len, --pack and --step cut a .npz document file "
                         "(--lengths-from FILE.npz)")
    if given is None and path is None:
        return None
    if path is not None and str(path).endswith(".npz"):
        try:
            docs = documents.open_documents(path, flag="--lengths-from")
            found = documents.step_lengths(docs.lengths, args.step, num_microbatches,
                                           max_seq_len=args.max_seq_len, pack=args.pack)
        except documents.DocumentError as exc:
            raise UsageError(str(exc)) from None
        return found
    where = "--lengths"
    if path is not None:
        where = str(path)
        try:
            given = ",".join(line.split("#")[0].strip() for line in Path(path).read_text().splitlines()
                             if line.split("#")[0].strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--lengths-from: cannot read {path} ({exc})") from None
    items = [x.strip() for x in str(given).split(",")]
    if not all(x.isdigit() and int(x) >= 1 for x in items):
        bad = next(x for x in items if not (x.isdigit() and int(x) >= 1))
        raise UsageError(f"{where}: a length is a whole number of tokens >= 1, not {bad!r}")
    if len(items) != num_microbatches:
        raise UsageError(f"{where}: {len(items)} lengths for the schedule's {num_microbatches} "
                         "microbatches; give one per microbatch of the step")
    return [int(x) for x in items]


def with_lengths(compiled: Compiled, args: argparse.Namespace, *,
                 memory_over_time: bool = False) -> Compiled:
    """`compiled` with its timeline simulated under the command line's lengths
    (each pass at its microbatch's cost, each microbatch's own memory), or as
    it is when none are given."""
    from dataclasses import replace

    from ppdsl.analysis.simulate import simulate

    lengths = lengths_from_args(args, compiled.schedule.num_microbatches)
    if lengths is None:
        return compiled
    timeline = simulate(compiled.schedule, lengths=lengths, memory_over_time=memory_over_time)
    return replace(compiled, timeline=timeline)


def compile_from_args(args: argparse.Namespace) -> Compiled:
    """Compile FILE with the -D overrides of the command line (and, where the
    command has them, `--no-early-receives`, `--costs-from` and `--comm-model`)."""
    early = not getattr(args, "no_early_receives", False)
    return compile_file(
        args.file, parse_defines(args.defines), early_receives=early, costs=costs_from_args(args),
        comm_model=getattr(args, "comm_model", "rendezvous"),
        topology=topology_from_args(args), dp=getattr(args, "dp", 1),
    )


def add_topology_argument(parser: argparse.ArgumentParser) -> None:
    """`--topology FILE` (read by `topology_from_args`)."""
    parser.add_argument(
        "--topology", metavar="FILE", default=None,
        help="time each transfer over the link between its ranks' GPUs (latency + bytes / "
        "bandwidth, bytes from `memory bytes[s]`) and, with --dp and `memory grad_bytes[s]`, "
        "each stage's reduction as a ring over its replicas: a file of nodes, gpus_per_node, "
        "intra_/inter_latency and _bandwidth (ppdsl/topology.py), or those pairs "
        "comma-separated",
    )


def topology_from_args(args: argparse.Namespace) -> Topology | None:
    """The `--topology` file or pairs, parsed (None without the option); a bad
    one raises its located `TopologyError`."""
    spec = getattr(args, "topology", None)
    return load_topology(spec) if spec else None
