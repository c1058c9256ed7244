import sys

from steerable.entrypoints.cli import main

sys.exit(main())
