import os
import sys

# tests/kit.py is imported as `kit` from every test folder.
sys.path.insert(0, os.path.dirname(__file__))
