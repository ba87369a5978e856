"""The ``ckpt`` command: ``ls``, ``inspect``, ``verify``, ``diff``, ``export`` and ``gc``.

Exit codes: 0 all good; 1 a check failed; 2 usage or environment error (missing root...).
Every subcommand takes ``--json`` for machine-readable output on stdout, and a root or one
checkpoint directory (a step directory, or what ``ckpt.save`` wrote). This module parses
arguments and turns errors into exit codes; the subcommands live in ``verify/_commands.py``
and ``verify/_gc.py``, the retention they apply in ``ckpt/_retention``.
"""

from __future__ import annotations

import argparse
import math
import os
import select
import signal
import sys
import traceback
from typing import Sequence

import verify
from ckpt.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                         StepOrderError, StorageError)

from ._commands import cmd_diff, cmd_export, cmd_inspect, cmd_ls, cmd_verify
from ._console import echo
from ._gc import add_gc_parser, check_gc_combinations
from ._interop import add_import_parser
from .report import EXIT_FAILED, EXIT_USAGE

# Output cut short by a closed pipe (`ckpt ls ROOT | head -1`): quiet, with the status a shell
# shows for a process killed by SIGPIPE.
EXIT_PIPE = 128 + signal.SIGPIPE
EXIT_INTERNAL = 3  # a bug in ckpt: still one line (or one JSON document), not a traceback
EXIT_INTERRUPTED = 128 + signal.SIGINT
TRACEBACK_VARIABLE = "CKPT_TRACEBACK"  # set (to anything) to see a bug's traceback instead


EPILOG = """\
PATH is a checkpoint root (the directory holding step-XXXXXXXX directories), one step
directory of a root, one checkpoint directory written by ckpt.save, or a Lightning .ckpt
written by CkptCheckpointIO (its step; verify also checks the file against it).

exit status:
  0  success: every check passed (verify), or the command did what was asked
  1  a check failed: a damaged or inconsistent checkpoint (the message names the file
     and the check: manifest, structure, header, digest, weights, output, loss,
     file for a Lightning .ckpt, also one whose step its root no longer holds); gc
     found no step that verifies, so it retired none;
     diff --exit-code: the steps differ
  2  usage or environment error: a missing root or step, no probe recorded for
     --level forward, a model factory that cannot be imported or does not fit,
     a root locked by a writer (gc --yes), storage that cannot be opened or written
     (a file, a read-only root, an unknown protocol, a missing backend library, an
     unreachable endpoint), bad arguments, a file ckpt cannot check (a .ckpt of
     Lightning's own IO), a Lightning .ckpt whose sibling root is missing
  3    an internal error, a bug in ckpt (one line; CKPT_TRACEBACK=1 shows the traceback)
  130  interrupted (Ctrl-C)
  141  stdout closed by its reader (ckpt ls ROOT | head -1): quiet, as after SIGPIPE

examples:
  ckpt ls /ckpt/run1
  ckpt inspect /ckpt/run1 --step 500                   # tensors and saved values (LR...)
  ckpt verify /ckpt/run1                               # newest step, digest level
  ckpt verify /ckpt/run1 --all --level structure --json
  ckpt verify /ckpt/run1 --level forward --model mypkg.models:build
  ckpt verify /ckpt/run1 --level forward --trust-recorded   # the factory the probe names
  ckpt verify out/ckpt0                                # what ckpt.save wrote
  ckpt diff /ckpt/run1 400 500
  ckpt diff /ckpt/run1 /ckpt/run2 --filter 'optim/*'   # two runs, newest steps
  ckpt diff /ckpt/run1 400 500 --exit-code --filter 'model/*'   # exit 1 if they differ
  ckpt export /ckpt/run1 --step 500 --to safetensors model.safetensors --item model
  ckpt gc /ckpt/run1 --keep-last 3 --yes

With --json every subcommand prints one JSON document on stdout, errors included
({"ok": false, "exit_code": 2, "error": "..."}).
"""


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


MAX_THREADS = 256  # each reading thread holds a chunk buffer (8 MiB by default)


def _threads(text: str) -> int:
    value = _positive(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_THREADS}, not {value}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _count(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt", description="List, inspect, verify, compare, export, import and "
        "collect checkpoints.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    path_help = "a root, a step directory, a ckpt.save directory or a CkptCheckpointIO .ckpt"

    p = sub.add_parser("ls", help="list committed steps")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="tensors, shapes, dtypes and saved values of a step")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.add_argument("--step", type=int, help="default: the newest")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check a step's integrity (newest by default)",
                       description="Each level includes the ones before it. structure: "
                       "manifest, files, sizes, safetensors headers. digest: every chunk's "
                       "xxh3 digest. forward: load into a fresh model, weights finite, "
                       "rerun the recorded probe and compare.")
    p.add_argument("root", metavar="PATH", help=path_help)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int)
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--level", choices=verify.LEVELS, default="digest",
                   help="default: digest")
    p.add_argument("--model", metavar="MOD:FACTORY",
                   help="forward: builds a fresh model")
    p.add_argument("--trust-recorded", action="store_true",
                   help="forward: import and run the factory and loss function the probe "
                        "recorded (code the checkpoint names: only for checkpoints you trust)")
    p.add_argument("--loss", metavar="MOD:FN",
                   help="forward: loss_fn(output, inputs), to recheck a recorded loss")
    p.add_argument("--rtol", type=_tolerance,
                   help="forward: relative tolerance (default by dtype)")
    p.add_argument("--atol", type=_tolerance,
                   help="forward: absolute tolerance (default by dtype)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "diff", help="which tensors and values changed between two steps or two runs",
        usage="ckpt diff ROOT A B | ckpt diff PATH_A PATH_B [--step-a N] [--step-b N] "
        "[--filter PATTERN] [--exit-code] [--json] [--threads N]",
        description="ROOT A B: step A against step B of one root. PATH_A PATH_B: two roots "
        "or checkpoint directories (two runs), the newest step of each unless --step-a/"
        "--step-b say otherwise.")
    p.add_argument("operands", nargs="+", metavar="ROOT A B | PATH_A PATH_B")
    p.add_argument("--step-a", type=int, help="with two paths: the step of PATH_A")
    p.add_argument("--step-b", type=int, help="with two paths: the step of PATH_B")
    p.add_argument("--filter", action="append", metavar="PATTERN",
                   help="only tensors (key, or optimizer state by parameter name) and values "
                   "matching this shell-style pattern, e.g. 'model/*' or '*exp_avg*' "
                   "(repeatable); per-rank items are named ITEM@RANK/..., e.g. 'rng@*'")
    p.add_argument("--exit-code", action="store_true",
                   help="exit 1 when the steps differ in what was compared, 0 when they are "
                   "the same (as git diff --exit-code); without it diff exits 0 either way")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("export", help="write a step as one safetensors or torch file")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--to", choices=(*verify.FORMATS, "hf", "dcp"), required=True,
                   help="hf: a from_pretrained folder (sharded safetensors, index, config); "
                   "dcp: a PyTorch DCP directory (dcp.load reads it on any world size)")
    p.add_argument("file", metavar="FILE", help="the file (the folder, for hf and dcp) to "
                   "write")
    p.add_argument("--max-shard-size", help="hf: the largest shard (default 5GB)")
    p.add_argument("--item", help="only this item's tensors, named as inside it "
                   "(a module's state_dict names)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_export)

    add_gc_parser(sub, _count)
    add_import_parser(sub, path_help)

    for name, p in sub.choices.items():
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if name in ("verify", "diff", "export", "gc"):
            p.add_argument("--threads", type=_threads, default=4,
                           help=f"parallel reads (default 4, at most {MAX_THREADS})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (see the epilog)."""
    args = build_parser().parse_args(argv)
    try:
        _check_combinations(args)
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except BrokenPipeError as e:
        if _stdout_closed():
            return EXIT_PIPE
        return _error(args, f"{type(e).__name__}: {e}", EXIT_USAGE)
    except (CheckpointNotFoundError, CheckpointLockedError, StorageError,
            verify.UsageError) as e:
        return _error(args, f"{e}{_advice(e)}", EXIT_USAGE, path=getattr(e, "path", None))
    except StepOrderError as e:  # ckpt import: a step number the root's order refuses
        if e.step is None or e.newest is None:
            first = str(e)
        elif e.step == e.newest:
            first = f"step {e.step} is already saved in {e.path}"
        else:
            first = f"a newer step, {e.newest}, is saved in {e.path}"
        return _error(args, f"{first}; give a --step after the root's newest step, or "
                      "import into another ROOT", EXIT_USAGE, path=getattr(e, "path", None))
    except CheckpointError as e:  # damage: say where the good steps are
        hint = "; `ckpt verify --all` tells which steps are good"
        if args.command in ("inspect", "export") and args.step is None:
            hint += " and --step N picks one"
        return _error(args, f"{e}{hint}", EXIT_FAILED, path=getattr(e, "path", None))
    except (OSError, ImportError) as e:  # the environment: permissions, a missing library
        hint = "; check the path and its permissions" if isinstance(e, OSError) else ""
        return _error(args, f"{type(e).__name__}: {e}{hint}", EXIT_USAGE,
                      path=getattr(e, "filename", None))
    except KeyboardInterrupt:
        return _error(args, "interrupted", EXIT_INTERRUPTED)
    except Exception as e:  # whatever a checkpoint holds, a bug's report stays one line
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return _error(args, f"internal error (a bug in ckpt): {type(e).__name__}: {e} (in "
                      f"{os.path.basename(frame.filename)}:{frame.lineno}); rerun with "
                      f"{TRACEBACK_VARIABLE}=1 for the traceback and report it",
                      EXIT_INTERNAL)


# botocore's errors for credentials it found nowhere or found in part (by name: botocore is
# an optional dependency); their message says what is missing, not where to give it.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError"})


def _advice(error: BaseException) -> str:
    """What to do about an error whose cause's message does not say (the object store's
    credentials), to append to it; "" for any other."""
    cause: BaseException | None = error
    for _ in range(8):  # a chain of causes, not a cycle
        if cause is None:
            break
        if type(cause).__name__ in _NO_CREDENTIALS:
            return ("; give the object store's credentials as every AWS tool reads them: "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
                    "~/.aws/credentials (and AWS_ENDPOINT_URL for a store other than AWS)")
        cause = cause.__cause__ or cause.__context__
    return ""


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) that its reader closed, as opposed to a broken
    connection of a storage backend; if so, point it at /dev/null so that Python's flush at
    exit prints no "Exception ignored" message."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return True
    except (OSError, ValueError, AttributeError):
        return False  # not a real file descriptor (captured output)


def _check_combinations(args: argparse.Namespace) -> None:
    """Options that mean nothing with the others given are refused, not ignored."""
    if args.command == "gc":
        check_gc_combinations(args)
    if args.command == "export" and args.max_shard_size and args.to != "hf":
        raise verify.UsageError("--max-shard-size is for --to hf")


def _error(args: argparse.Namespace, error: Exception | str, code: int,
           path: str | None = None) -> int:
    echo(f"ckpt {args.command}: {error}", file=sys.stderr)
    if getattr(args, "json", False):
        echo(verify.to_json({"ok": False, "exit_code": code, "error": str(error),
                            "path": path or getattr(error, "path", None)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
