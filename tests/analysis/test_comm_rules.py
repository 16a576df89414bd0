"""The communication rule sets (ppdsl/analysis/comm_rules.py's docstring): each
NCCL rule on the smallest program that shows it, against rendezvous and gloo."""

from __future__ import annotations

from ppdsl.analysis.comm_rules import Item, Part, run


def send(label: str, peer: int, t: str) -> Item:
    return Item(label, parts=(Part(True, peer, t, t),))


def recv(label: str, peer: int, t: str) -> Item:
    return Item(label, parts=(Part(False, peer, t, t),))


def group(label: str, *parts: Part) -> Item:
    return Item(label, parts=parts, group=True)


def compute(label: str, *takes: str) -> Item:
    return Item(label, takes=takes)


def verdicts(programs) -> dict[str, bool]:
    return {m: run(programs, m).ok for m in ("rendezvous", "nccl", "gloo")}


def test_send_before_receive_both_ways_hangs_without_buffering():
    """Two ranks that each send before they receive, lone ops on their pair's
    communicator, hang under NCCL (no buffering) and rendezvous, not under gloo."""
    programs = [
        [compute("a"), send("s01", 1, "x"), recv("r10", 1, "y"), compute("b", "y")],
        [compute("c"), send("s10", 0, "y"), recv("r01", 0, "x"), compute("d", "x")],
    ]
    assert verdicts(programs) == {"rendezvous": False, "nccl": False, "gloo": True}
    (cycle,) = run(programs, "nccl").cycles
    assert {w.rank for w in cycle} == {0, 1}
    assert all("pair 0-1" in w.text for w in cycle)


def test_a_group_posts_its_parts_together():
    """The same transfers as one group per rank run under every rule set."""
    programs = [
        [compute("a"), group("g0", Part(True, 1, "x", "x"), Part(False, 1, "y", "y")),
         compute("b", "y")],
        [compute("c"), group("g1", Part(True, 0, "y", "y"), Part(False, 0, "x", "x")),
         compute("d", "x")],
    ]
    assert verdicts(programs) == {"rendezvous": True, "nccl": True, "gloo": True}


def test_a_receive_ahead_on_its_stream_holds_a_send_back():
    """Rank 0 receives y then sends x on one stream; rank 1 receives x before it
    sends y: NCCL hangs (the receive holds the send back), gloo does not."""
    programs = [
        [recv("r10", 1, "y"), send("s01", 1, "x"), compute("a", "y")],
        [recv("r01", 0, "x"), send("s10", 0, "y"), compute("b", "x")],
    ]
    assert verdicts(programs) == {"rendezvous": False, "nccl": False, "gloo": True}


def test_streams_of_different_communicators_do_not_hold_each_other():
    """A send to rank 1 and a receive from rank 2 are on two pair communicators:
    the receive waiting does not hold the send back under NCCL."""
    programs = [
        [recv("r20", 2, "z"), send("s01", 1, "x"), compute("a", "z")],
        [recv("r01", 0, "x"), compute("b", "x"), send("s12", 2, "w")],
        [recv("r12", 1, "w"), compute("c", "w"), send("s20", 0, "z")],
    ]
    assert run(programs, "nccl").ok
    assert not run(programs, "rendezvous").ok  # rank 0 blocks at its receive


def test_an_operation_starts_after_the_computation_issued_before_it():
    """A send issued after a computation that waits for a later receive never
    starts: the computation waits on the receive, the receive's stream is the
    send's (one group communicator)."""
    programs = [
        [compute("a", "y"), group("g0", Part(True, 1, "x", "x")),
         group("g0b", Part(False, 1, "y", "y"))],
        [group("g1", Part(False, 0, "x", "x")), group("g1b", Part(True, 0, "y", "y"))],
    ]
    nccl = run(programs, "nccl")
    assert not nccl.ok
    texts = " ".join(w.text for c in nccl.cycles for w in c)
    assert "cannot start before its a has run" in texts


def test_the_nth_send_meets_the_nth_receive():
    """Two tensors sent x, y and received y, x between the same ranks on one
    communicator: a crossed pair under NCCL, fine where tags match them."""
    programs = [
        [group("g0", Part(True, 1, "x", "x"), Part(True, 1, "y", "y"))],
        [group("g1", Part(False, 0, "y", "y"), Part(False, 0, "x", "x")), compute("b", "x", "y")],
    ]
    nccl = run(programs, "nccl")
    assert not nccl.ok and nccl.crossed
    assert "crossed pair" in nccl.cycles[0][0].text
    assert run(programs, "rendezvous").ok and run(programs, "gloo").ok


def test_a_receive_nothing_sends_is_unmatched():
    """A receive with no send anywhere is reported as unmatched under every rule set."""
    programs = [[recv("r", 1, "x"), compute("a", "x")], [compute("b")]]
    for model in ("rendezvous", "nccl", "gloo"):
        verdict = run(programs, model)
        assert verdict.unmatched == [(0, 0, "receive x from rank 1")], model
