"""`python -m training.retrain`: scheduled retrain of the decider; the pipeline lives in `training.decider.retrain`."""
import sys

from training.decider.retrain import main

if __name__ == "__main__":
    sys.exit(main())
