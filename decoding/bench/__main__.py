import sys

from decoding.bench.cli import main

sys.exit(main())
