import sys

if "gpu" in sys.argv[1:] and sys.argv[sys.argv.index("gpu") - 1] == "--suite":  # its own options
    from decoding.bench.gpu_suite import main
else:
    from decoding.bench.cli import main

sys.exit(main())
