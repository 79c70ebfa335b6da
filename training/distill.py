"""`python -m training.distill`: distil a draft or feature head; the pipeline lives in `training.draft.distill`."""
from training.draft.distill import main

if __name__ == "__main__":
    main()
