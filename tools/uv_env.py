"""Print `export UV_...=...` lines that give uv the package sources pip is configured with on this machine.

`make venv` installs with uv (4-5x less CPU than pip on the test environments); uv does not read pip's
configuration, so a machine whose wheels come from pip's settings (a local torch CPU wheel through `find-links`,
extra local indexes, a constraints file, a CA bundle) would otherwise resolve elsewhere, e.g. a multi-GB CUDA torch.
Reads `pip config list` (files and PIP_* variables, pip's own precedence); a setting pip lacks is left unset.
Usage: `eval "$(python3 -m tools.uv_env)"`. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's setting -> uv's variable. uv reads several extra indexes or find-links from one space-separated value;
# pip's "best version from any index" is uv's unsafe-best-match (uv's default prefers the first index that has a name).
PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
    "default-timeout": "UV_HTTP_TIMEOUT",
}


def pip_settings(listing: str) -> dict[str, str]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`, `:env:.cert='...'`) -> {name: value}; a PIP_*
    variable (`:env:`) wins over a file, as in pip."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        section, name = key.rsplit(".", 1)
        if section not in (":env:", "global", "install"):
            continue
        (env if section == ":env:" else files)[name] = shlex.split(value)[0] if value.strip() else ""
    return {**files, **env}


def uv_exports(settings: dict[str, str]) -> list[str]:
    lines = [f"export {var}={shlex.quote(settings[name])}" for name, var in PIP_TO_UV.items() if settings.get(name)]
    if settings.get("extra-index-url") or settings.get("find-links"):
        lines.append("export UV_INDEX_STRATEGY=unsafe-best-match")
    return lines


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(uv_exports(pip_settings(listing))))


if __name__ == "__main__":
    main()
