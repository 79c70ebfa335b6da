"""`python -m training.export`: export a trained head; the command lives in `training.export.formats`."""
import sys

import torch

from training.export.formats import main

if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.exit(main())
