"""Where the tests find the recordings of a real vLLM 0.32 server.

``VLLM_032``: responses, streams, error bodies and ``/metrics`` expositions
recorded from a real vLLM 0.32.0 (CPU build) server started like
``realvllm.SERVER_FLAGS``. They are test data kept outside the repository, in
``shared/fixtures/vllm-0.32-cpu/`` beside the clone (as CI lays it out); tests
read them by name (``VLLM_032 / "metrics_a_after_start.prom.txt"``).

``tests/`` is on ``sys.path`` (see ``realvllm.py``), so ``from recordings import
VLLM_032`` works from every test directory.
"""

from __future__ import annotations

from pathlib import Path

#: The clone's parent: CI puts ``shared/`` there.
_BESIDE_CLONE = Path(__file__).resolve().parents[2]

VLLM_032 = _BESIDE_CLONE / "shared" / "fixtures" / "vllm-0.32-cpu"
