import os
import sys

# The spawn harness's children re-import test modules by name; make the repo root and this
# folder importable in them too (pytest's own sys.path edits are inherited through spawn).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
