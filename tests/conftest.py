import os
import sys

# Child processes started by `spawn` import test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
