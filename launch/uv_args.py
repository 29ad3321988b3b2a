"""pip's package-choosing settings as uv's options, for launch/setup.sh.

uv installs what pip would in a fraction of the time, but reads none of pip's configuration: a machine whose pip
finds torch's CPU build in a local folder (find-links), a mirror (index URLs) or a version cap (constraints) would
get something else from uv. This prints, one per line, the certificate pip uses (an empty line if none; for
SSL_CERT_FILE) and then uv's options for the same settings; it exits 1 on a setting uv would not honour the same
way, leaving the install to pip.
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's precedence: its environment variables, then the [install] section, then [global]
PRECEDENCE = {":env:": 2, "install": 1, "global": 0}
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# settings that change how pip talks, prints or checks where it runs, not which packages it picks
IGNORED = {"default-timeout", "timeout", "retries", "disable-pip-version-check", "no-compile", "quiet", "verbose",
           "log", "progress-bar", "root-user-action", "no-cache-dir", "cache-dir", "no-input", "require-virtualenv",
           "no-warn-script-location", "no-python-version-warning"}  # fmt: skip


def uv_args(listed: str) -> tuple[str, list[str]] | None:
    """(certificate, uv options) for the settings in `pip config list`'s output, None if one has no match."""
    entries = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in PRECEDENCE:
            entries.append((PRECEDENCE[section], name, value))
    # in order of precedence, the strongest last: its value stays
    settings = {name: ast.literal_eval(value) for _, name, value in sorted(entries)}
    cert = settings.pop("cert", "")
    args = ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version from any index
    for name, value in settings.items():
        if name in FLAGS:
            args += [part for item in value.split() for part in (FLAGS[name], item)]
        elif name not in IGNORED:
            return None
    return cert, args


def main() -> int:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    got = uv_args(listed)
    if got is None:
        return 1
    cert, args = got
    print("\n".join([cert, *args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
