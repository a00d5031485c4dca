"""``python -m flashmask``: what this installation can run (flashmask/env_report.py)."""
import sys

from flashmask.env_report import main

if __name__ == "__main__":
    sys.exit(main())
