"""`python -m training.fit`: fit a decider; the pipeline lives in `training.decider.fit`."""
import sys

from training.decider.fit import main

if __name__ == "__main__":
    sys.exit(main())
