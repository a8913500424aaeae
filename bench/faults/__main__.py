"""`python -m bench.faults`: the fault-injection bench (see bench/faults/__init__.py)."""

import sys

from bench.faults import main

if __name__ == "__main__":
    # argparse names the program after sys.argv[0], here .../bench/faults/__main__.py: the
    # usage line says faults.py, as it did when the bench was one file.
    sys.argv[0] = "faults.py"
    sys.exit(main())
