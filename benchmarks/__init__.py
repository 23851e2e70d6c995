"""Side-by-side speed measurements (`python -m benchmarks.run_all`).

Every benchmark runs offline and quiet: no telemetry, no hub look-ups, no progress bars from transformers. Set here,
in the package every benchmark module is imported through, so it holds before any library reads it at import.
A benchmark is one run: the servers it starts get this process's run secret, and its clients send it
(components/serving/auth.py).
"""

import os
import secrets

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RLHF_RUN_SECRET", secrets.token_urlsafe(32))
