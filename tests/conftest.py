import os
import sys

# Tests import `flashmask` and `masks` from this checkout even when the package isn't installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
