"""`python -m training.collect`: record decider traces; the pipeline lives in `training.decider.collect`."""
import sys

from training.decider.collect import main

if __name__ == "__main__":
    sys.exit(main())
