"""ppdsl/runtime/program.py: the vocabulary generated rank programs are written in
builds the rank-program IR the lowering builds (docs/architecture.md)."""

from __future__ import annotations

from ppdsl.compiler import compile_file
from ppdsl.ir.rank import Compute, Exchange, Transfer
from ppdsl.runtime import program
from tests.paths import EXAMPLES


def _spelled(op: object) -> str:
    """An op as a generated program spells it (the call that builds it)."""
    if isinstance(op, Compute):
        return f"{op.pass_.kind.name}({op.pass_.microbatch}, {op.pass_.stage})"
    assert isinstance(op, Exchange)

    def transfer(t: Transfer) -> str:
        return (f"{t.kind.name.lower()}({t.microbatch}, {t.src_stage}, {t.dst_stage}, "
                f"{t.src_rank}, {t.dst_rank})")

    sends = ", ".join(transfer(t) for t in op.sends)
    recvs = ", ".join(transfer(t) for t in op.recvs)
    return f"exchange(sends=({sends}{',' if len(op.sends) == 1 else ''}), " \
           f"recvs=({recvs}{',' if len(op.recvs) == 1 else ''}))"


def test_vocabulary_rebuilds_every_op_of_the_lowered_programs():
    """Each op of ZB-H1's and 1F1B's lowered rank programs, spelled as a generated
    program spells it and evaluated in the vocabulary, is the same op (a generated program carries no source span)."""
    names = {name: getattr(program, name) for name in program.__all__}
    for example, params in (("zb_h1.pp", {"d": "4", "m": "8"}), ("1f1b.pp", {"d": "2", "m": "4"})):
        compiled = compile_file(EXAMPLES / example, params)
        count = 0
        for rank_program in compiled.programs:
            for op in rank_program.ops:
                built = eval(_spelled(op), {}, names)
                assert _spelled(built) == _spelled(op) and type(built) is type(op)
                if isinstance(op, Compute):  # a generated program carries no span
                    assert built.pass_.key == op.pass_.key
                count += 1
        assert count > 0
