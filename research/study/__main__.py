"""`python -m research.study` (from the repository root); see research/study/cli.py."""

import sys

from research.study.cli import main

sys.exit(main())
