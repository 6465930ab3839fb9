"""Rewrite a hash-pinned lock for an offline install from a wheelhouse (used inside docker/Dockerfile).

Lines `name @ https://.../file.whl` (e.g. a flash-attn release wheel) would make pip download even with
--no-index; they become `/wheelhouse/file.whl`, keeping their --hash options, so pip still checks every
hash. Everything else is kept as it is. Usage: python localize_lock.py LOCK WHEELHOUSE > OUT
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

URL_REQ = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*(?P<url>\S+)(?P<rest>.*)$")


def localize(text: str, wheelhouse: Path) -> str:
    out = []
    for line in text.splitlines():
        m = URL_REQ.match(line)
        if m:
            filename = unquote(Path(urlsplit(m["url"]).path).name)
            local = wheelhouse / filename
            if not local.is_file():
                raise SystemExit(f"localize_lock: {m['name']} is pinned by URL but {local} is not in the wheelhouse")
            line = f"{local}{m['rest']}"
        out.append(line)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: localize_lock.py LOCK WHEELHOUSE")
    sys.stdout.write(localize(Path(sys.argv[1]).read_text(), Path(sys.argv[2])))
