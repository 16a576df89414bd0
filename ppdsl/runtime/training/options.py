"""The training options of `ppdsl run` and of the generated `launch.py`, declared
once (no torch here: `ppdsl run` reads them before anything imports torch).

`ppdsl run` declares them with `forward=True` (no defaults) and hands the ones
given on to the ranks (`training_argv`); the ranks parse them with their
defaults (`training_default` reads one). `check_training_options` is the one
place their limits are checked; each choice list is a tuple of
`ppdsl.runtime.choices`.
"""

from __future__ import annotations

import argparse
from typing import Any

from ppdsl.runtime.choices import (
    CUT_RULES,
    DATA_DTYPES,
    DEVICES,
    DP_MODES,
    LR_SCHEDULES,
    OPTIMIZERS,
    PARAM_DTYPES,
    PRECISIONS,
    REDUCE_DTYPES,
    RELEASES,
    VALIDATIONS,
)

__all__ = ["add_training_options", "training_argv", "training_default", "check_training_options"]

# (flag, destination, argparse keywords, default on the ranks)
_OPTIONS: list[tuple[str, str, dict[str, Any], Any]] = [
    ("--model", "model", {
        "required": True, "metavar": "FILE.py:FACTORY",
        "help": "the model: a factory, e.g. examples/models/tiny_gpt.py:stages, or hf:DIR, a "
                "transformers checkpoint folder (docs/runtime.md)"}, None),
    ("--steps", "steps", {"type": int, "help": "training steps (default 20)"}, 20),
    ("--batch-size", "batch_size", {
        "type": int, "help": "samples per step, split into m microbatches (default 2*m, times "
                             "--dp)"}, None),
    ("--timeout", "timeout", {
        "type": float,
        "help": "seconds before a dead or hung rank makes the others stop (default 60)"}, 60.0),
    ("--device", "device", {
        "choices": DEVICES,
        "help": "auto (default): CUDA when the node has a GPU per local rank, else CPU with a "
                "note; cuda with fewer GPUs than local ranks is an error (exit 2)"}, "auto"),
    ("--release", "release", {
        "choices": RELEASES,
        "help": "when a split backward frees activations: at-b (default) frees at B what W "
                "does not need; at-w keeps the autograd graph until W (M_W = M_B, the "
                "controllable-memory paper's accounting)"}, "at-b"),
    ("--json", "json_out", {
        "metavar": "DIR", "help": "write each rank's measurements to DIR/rank<N>.json"}, None),
    ("--trace", "trace", {
        "metavar": "OUT.json",
        "help": "write every rank's passes as one Chrome/Perfetto trace (ui.perfetto.dev)"}, None),
    ("--optimizer", "optimizer", {"choices": OPTIMIZERS,
                                  "help": "torch.optim optimizer (default adam)"}, "adam"),
    ("--lr", "lr", {"type": float, "help": "learning rate (default 3e-3)"}, 3e-3),
    ("--weight-decay", "weight_decay", {"type": float, "help": "weight decay (default 0)"}, 0.0),
    ("--momentum", "momentum", {"type": float, "help": "SGD momentum (default 0)"}, 0.0),
    ("--lr-schedule", "lr_schedule", {
        "choices": LR_SCHEDULES,
        "help": "constant (default), or a linear warm-up over --warmup-steps then a cosine "
                "decay to 0 at --steps"}, "constant"),
    ("--warmup-steps", "warmup_steps", {"type": int, "help": "warm-up steps (default 0)"}, 0),
    ("--clip-grad-norm", "clip_grad_norm", {
        "type": float, "metavar": "MAX",
        "help": "clip gradients by their global norm across all pipeline ranks"}, None),
    ("--optimizer-validation", "optimizer_validation", {
        "choices": VALIDATIONS,
        "help": "sync (default): all-reduce the gradient norm and inf/NaN flags, then step; "
                "post: step at once, validate before the next step's first pass and roll "
                "back (skip, or redo clipped) when needed (the zero-bubble paper's §4)"}, "sync"),
    ("--precision", "precision", {
        "choices": PRECISIONS,
        "help": "fp32 (default); bf16 or fp16 autocast (fp16 with dynamic loss scaling, one "
                "inf/NaN decision for all ranks); autocast decides each op's dtype inside "
                "the forward, on top of --param-dtype"}, "fp32"),
    ("--param-dtype", "param_dtype", {
        "choices": PARAM_DTYPES,
        "help": "the dtype the stages' parameters are kept and computed in: fp32 (default) "
                "or bf16, with fp32 master weights and optimizer state (FSDP2's "
                "MixedPrecisionPolicy under --dp-mode shard, the same semantics without "
                "it); composes with --precision bf16, not with fp16"}, "fp32"),
    ("--reduce-dtype", "reduce_dtype", {
        "choices": REDUCE_DTYPES,
        "help": "the dtype data-parallel gradient reductions run in (default fp32)"}, "fp32"),
    ("--seed", "seed", {
        "type": int,
        "help": "seed of torch's and Python's RNGs on every rank, before the model is built "
                "(default 0): dropout and the like draw the same on a rerun"}, 0),
    ("--checkpoint-dir", "checkpoint_dir", {
        "metavar": "DIR", "help": "save checkpoints (torch.distributed.checkpoint) under DIR"}, None),
    ("--checkpoint-every", "checkpoint_every", {
        "type": int, "metavar": "N",
        "help": "save every N steps (default: after the last step only)"}, None),
    ("--stop-after", "stop_after", {
        "type": int, "metavar": "N",
        "help": "stop after N steps, saving a checkpoint, as an interrupted run would; "
                "--steps still sets the run's length (the LR schedule's)"}, None),
    ("--dp", "dp", {
        "type": int, "metavar": "N",
        "help": "data-parallel replicas of the pipeline (world = N x pipeline ranks, a 2-D "
                "mesh ('dp', 'pp'); global rank = replica * pipeline ranks + pipeline rank; "
                "default: as compiled, else 1)"}, None),
    ("--dp-mode", "dp_mode", {
        "choices": DP_MODES,
        "help": "replicate: all-reduce each stage's gradients after its last W (DDP); "
                "shard: FSDP2 fully_shard per stage on the dp sub-mesh, gathered once per "
                "step, gradients reduce-scattered after its last W (default: as compiled, "
                "else replicate)"}, None),
    ("--share-gpu", "share_gpu", {
        "action": "store_true",
        "help": "let the ranks of a node share its GPUs when it has fewer than ranks (a "
                "development mode: they time-slice the GPU); transfers go through pinned host "
                "memory over gloo. Without a GPU the ranks run on CPU with the same staged "
                "transfers"}, False),
    ("--eval-every", "eval_every", {
        "type": int, "metavar": "N",
        "help": "every N steps (and after the last), a validation loss: --eval-batches "
                "forward-only steps on the model's eval_batch data (runner.evaluate)"}, None),
    ("--eval-batches", "eval_batches", {
        "type": int, "metavar": "K",
        "help": "evaluation batches per validation loss (default 1)"}, 1),
    ("--data", "data", {
        "metavar": "FILE",
        "help": "with --model hf:DIR: a flat array of token ids (.npy, or raw .bin of uint16 as "
                "nanoGPT writes); step k uses sequences k*B .. (k+1)*B-1 of L+1 consecutive "
                "tokens from the file's start, wrapping at its end (default: synthetic tokens "
                "from --seed)"}, None),
    ("--eval-data", "eval_data", {
        "metavar": "FILE",
        "help": "with --model hf:DIR: held-out token ids for --eval-every (same format as "
                "--data; evaluation batch k takes sequences by the same rule)"}, None),
    ("--data-dtype", "data_dtype", {
        "choices": DATA_DTYPES,
        "help": "element type of a raw .bin token file (default uint16)"}, "uint16"),
    ("--max-seq-len", "max_seq_len", {
        "type": int, "metavar": "L",
        "help": "with --data FILE.npz (documents: tokens and offsets): step k's microbatch j is "
                "document (k*m + j) mod N cut to its first L tokens (default: whole documents)"},
     None),
    ("--pack", "pack", {
        "type": int, "metavar": "T",
        "help": "with --data FILE.npz: pack documents greedily in order into microbatches of at "
                "most T tokens (a longer one cut to T); each document attends only within "
                "itself, its positions from 0"}, None),
    ("--reorder", "reorder", {
        "action": "store_true",
        "help": "with --data FILE.npz: each step runs its microbatches in the order of the "
                "schedule's slots that the simulator finds shortest under the per-token costs "
                "(ppdsl.analysis.reorder.choose_order, within 50 ms; any permutation keeps the "
                "compiled proofs)"}, False),
    ("--seq-len", "seq_len", {
        "type": int, "metavar": "L", "help": "with --model hf:DIR: tokens per sample (default 64)"},
     64),
    ("--cut", "cut", {
        "metavar": "|".join(CUT_RULES) + "|0,5,11",
        "help": "with --model hf:DIR: where the stages start: equal layer counts (default), "
                "balanced from a per-layer profile, or each stage's first decoder layer"},
     "equal"),
    ("--save-model", "save_model", {
        "metavar": "OUT",
        "help": "with --model hf:DIR: write the trained weights to OUT as a transformers "
                "checkpoint (AutoModelForCausalLM.from_pretrained(OUT) loads it) at the end, "
                "and to CHECKPOINT/hf with each checkpoint"}, None),
    ("--resume", "resume", {
        "action": "store_true",
        "help": "require a checkpoint to continue from (with --checkpoint-dir a run resumes "
                "from the newest complete checkpoint there anyway, and starts fresh when "
                "there is none)"}, False),
    ("--keep-checkpoints", "keep_checkpoints", {
        "type": int, "metavar": "K",
        "help": "keep only the newest K checkpoints (default: all)"}, None),
    ("--sync-checkpoints", "sync_checkpoints", {
        "action": "store_true",
        "help": "write checkpoints before the next step starts (default: in the background, "
                "the state copied first)"}, False),
]


_DEFAULTS = {dest: default for _, dest, _, default in _OPTIONS}


def training_default(dest: str) -> Any:
    """The value the ranks take for the option stored at `dest` when it is not
    given (`--seq-len`'s 64 for "seq_len")."""
    return _DEFAULTS[dest]


def add_training_options(parser: argparse.ArgumentParser, *, forward: bool = False) -> None:
    """Declare the training options on `parser`; `forward=True` leaves them unset
    unless given (for a command that passes them on)."""
    for flag, dest, kwargs, default in _OPTIONS:
        kwargs = dict(kwargs)
        if kwargs.get("action") != "store_true":
            kwargs["default"] = None if forward else default
        parser.add_argument(flag, dest=dest, **kwargs)


def training_argv(args: argparse.Namespace) -> list[str]:
    """The options given in `args`, as command-line arguments again."""
    argv: list[str] = []
    for flag, dest, kwargs, _ in _OPTIONS:
        value = getattr(args, dest, None)
        if kwargs.get("action") == "store_true":
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def check_training_options(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the training options in `args` (a usage error),
    or None."""
    def given(name: str) -> Any:
        return getattr(args, name, None)

    if given("steps") is not None and given("steps") < 1:
        return f"--steps {given('steps')}: need at least 1 training step"
    if given("batch_size") is not None and given("batch_size") < 1:
        return f"--batch-size {given('batch_size')}: need at least 1 sample"
    if given("timeout") is not None and not given("timeout") > 0:
        return f"--timeout {given('timeout'):g}: need a positive number of seconds"
    if given("lr") is not None and not given("lr") > 0:
        return f"--lr must be positive, not {given('lr')}"
    if given("weight_decay") is not None and given("weight_decay") < 0:
        return f"--weight-decay must not be negative, not {given('weight_decay')}"
    if given("momentum") is not None and not 0 <= given("momentum") < 1:
        return f"--momentum must be in [0, 1), not {given('momentum')}"
    if given("momentum") and given("optimizer") not in (None, "sgd"):
        return "--momentum is SGD's; with --optimizer adam or adamw leave it out"
    if given("warmup_steps") is not None and given("warmup_steps") < 0:
        return f"--warmup-steps must not be negative, not {given('warmup_steps')}"
    if given("clip_grad_norm") is not None and not given("clip_grad_norm") > 0:
        return f"--clip-grad-norm must be positive, not {given('clip_grad_norm')}"
    if given("checkpoint_every") is not None:
        if given("checkpoint_every") < 1:
            return f"--checkpoint-every must be at least 1, not {given('checkpoint_every')}"
        if not given("checkpoint_dir"):
            return "--checkpoint-every needs --checkpoint-dir DIR"
    if given("stop_after") is not None:
        if given("stop_after") < 1:
            return f"--stop-after must be at least 1, not {given('stop_after')}"
        if not given("checkpoint_dir"):
            return "--stop-after needs --checkpoint-dir DIR (to resume from)"
    if given("dp") is not None and given("dp") < 1:
        return f"--dp must be at least 1, not {given('dp')}"
    if given("keep_checkpoints") is not None:
        if given("keep_checkpoints") < 1:
            return f"--keep-checkpoints must be at least 1, not {given('keep_checkpoints')}"
        if not given("checkpoint_dir"):
            return "--keep-checkpoints needs --checkpoint-dir DIR"
    if given("sync_checkpoints") and not given("checkpoint_dir"):
        return "--sync-checkpoints needs --checkpoint-dir DIR"
    if given("eval_every") is not None and given("eval_every") < 1:
        return f"--eval-every must be at least 1, not {given('eval_every')}"
    if given("eval_batches") is not None and given("eval_batches") < 1:
        return f"--eval-batches must be at least 1, not {given('eval_batches')}"
    model = given("model") or ""
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data"),
                       ("seq_len", "--seq-len"), ("cut", "--cut"),
                       ("save_model", "--save-model")):
        if given(dest) is not None and given(dest) != _DEFAULTS[dest] and not model.startswith("hf:"):
            return f"{flag} is for --model hf:DIR (a transformers checkpoint folder)"
    if given("eval_every") is not None and model.startswith("hf:") and not given("eval_data"):
        return ("--eval-every with --model hf:DIR needs --eval-data FILE (held-out token ids, "
                "the same format as --data)")
    if given("param_dtype") == "bf16" and given("precision") == "fp16":
        return ("--param-dtype bf16 with --precision fp16 would compute in fp16 from bf16 "
                "weights; use --precision bf16 (or fp32) with bf16 parameters")
    for dest, flag in (("max_seq_len", "--max-seq-len"), ("pack", "--pack")):
        if given(dest) is not None:
            if given(dest) < 1:
                return f"{flag} must be at least 1, not {given(dest)}"
            if not str(given("data") or "").endswith(".npz"):
                return f"{flag} is for documents: --data FILE.npz (tokens and offsets)"
    if given("reorder") and not str(given("data") or "").endswith(".npz"):
        return "--reorder is for documents: --data FILE.npz (tokens and offsets)"
    if given("max_seq_len") is not None and given("pack") is not None:
        return "--max-seq-len and --pack exclude each other: --pack T cuts documents to T tokens"
    if given("seq_len") is not None and given("seq_len") < 1:
        return f"--seq-len must be at least 1, not {given('seq_len')}"
    if given("resume") and not given("checkpoint_dir"):
        return "--resume needs --checkpoint-dir DIR (where the checkpoints are)"
    return None
