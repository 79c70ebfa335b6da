"""`python -m training.export`: export a trained head or draft; the pipeline lives in `training.serve.export`."""
import sys

import torch

from training.serve.export import main

if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.exit(main())
