"""``python -m gpupool``: what a bug report needs (``gpupool.diagnose``)."""

import sys

from gpupool.diagnose import main

sys.exit(main())
