"""`index_unreachable`: a log (`doctor --log`) of an install that could not reach its package index.

pip retries an unreachable index for minutes ("Retrying (Retry(...)) after connection broken by
'NewConnectionError(...)': /whl/cpu/torch/") and then reports "No matching distribution found"; the nox
sessions check the index first and stop with "... which cannot be reached". Either way the fix is a
reachable index: a mirror of PyTorch's index through NSA_PYTORCH_INDEX, or a cell whose torch is on PyPI.
"""

from __future__ import annotations

from nsa_env.doctor.core import Context, Finding

PIP_RETRY = (r"Retrying \(Retry\(.*after connection broken by '?(?:NewConnectionError|ConnectTimeoutError|"
             r"ProxyError|ReadTimeoutError)\([^\n]*?(?:\[Errno[^\]]*\]\s*)?([^\n']*)'?\)?'?: (\S+)")
NOX_PROBE = r"installs torch from (\S+), which cannot be reached \(([^)]*)\)"
FETCH = r"Could not fetch URL (\S+): There was a problem confirming the ssl certificate|Could not fetch URL (\S+):"


def check_index_unreachable(ctx: Context) -> list[Finding]:
    """Read from the log alone, so it also applies when torch is not installed (the install failed)."""
    m = ctx.in_log(NOX_PROBE)
    where, why = (m.group(1), m.group(2)) if m else (None, None)
    if not m and (m := ctx.in_log(PIP_RETRY)):
        where, why = m.group(2), m.group(1).strip() or "connection failed"
    if not m and (m := ctx.in_log(FETCH)):
        where, why = m.group(1) or m.group(2), "pip could not fetch it"
    if not m:
        return []
    return [Finding("index_unreachable", "error",
                    f"the install could not reach its package index ({where}: {why}); pip retries such an index "
                    "for minutes, then says no matching distribution was found.",
                    "Behind a mirror of PyTorch's index set NSA_PYTORCH_INDEX to its base URL (the one that replaces "
                    "PyTorch's /whl); or install a cell whose torch comes from PyPI (`python -m ci.matrix list` shows "
                    "each cell's index; the Quick-start cells of Python 3.10, 3.12 and 3.13 need no extra index).")]
