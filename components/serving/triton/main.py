"""The entry point of a server process, as the launcher starts it: one JSON document in, serve until SIGTERM/SIGINT.

    python -m components.serving.triton.main --spec '<ServerSpec JSON>'   a critic or reward server (rank 0 of one)
    python -m components.serving.triton.main --follow                     ranks 1..N-1 of a critic server (by rank 0)

`rlhf serve critic|reward` (components/cli/serve.py) maps its flags onto the same ServerSpec and calls `run`.
"""

from __future__ import annotations

import sys
from typing import Optional

from components.serving.triton.contract import ServerSpec
from components.serving.triton.critic import follow_critic
from components.serving.triton.serve import configure_logging, serve

USAGE = "usage: python -m components.serving.triton.main --spec '<ServerSpec JSON>' | --follow"


def run(spec: ServerSpec) -> int:
    """Serve until SIGTERM/SIGINT (blocking); returns the exit code."""
    configure_logging()
    for field in spec.loaded_models:  # pinned where the run started and here: else the start fails, naming the field
        spec.config.source(field)
    return serve(spec)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--spec":
        return run(ServerSpec.model_validate_json(argv[1]))
    if argv == ["--follow"]:
        configure_logging()
        return follow_critic()
    print(f"{USAGE}\n(a server with flags: rlhf serve critic|reward --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
