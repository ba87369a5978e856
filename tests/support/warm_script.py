"""The worker script of tests/trainer/test_warm.py, run through ``python -m trainer.warm``.

    warm_script.py report OUT [CODE]   write what this process sees to OUT, exit CODE
    warm_script.py wait OUT            write it, then wait (up to 60 s) for a signal

What it sees: its pid and parent, the markers a zygote sets, argv, cwd, ``__name__``,
``WARM_TEST_VALUE`` from the environment and the first line of stdin (``report``); it also
prints a line to stdout and to stderr.
"""

import json
import os
import sys
import time


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    seen = {"pid": os.getpid(), "ppid": os.getppid(),
            "zygote": os.environ.get("CKPT_WARM_ZYGOTE"),
            "launcher": os.environ.get("CKPT_WARM_LAUNCHER"), "argv": sys.argv,
            "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
            "value": os.environ.get("WARM_TEST_VALUE"),
            "stdin": sys.stdin.readline().strip() if mode == "report" else None,
            "pgid": os.getpgid(0)}
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(out + ".tmp", out)  # whole or absent for the test polling for it
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "wait":
        deadline = time.time() + 60
        while time.time() < deadline:
            time.sleep(0.05)
        return 0
    return int(sys.argv[3]) if len(sys.argv) > 3 else 0


if __name__ == "__main__":
    sys.exit(main())
