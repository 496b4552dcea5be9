import sys
from pathlib import Path

# qwen_testutils lives next to the tests; make it importable whatever the rootdir.
sys.path.insert(0, str(Path(__file__).parent))
