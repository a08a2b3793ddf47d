import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="dorarl[real] (gguf, accelerate) is not installed")
pytest.importorskip("accelerate", reason="dorarl[real] (gguf, accelerate) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent))
