"""matplotlib's figure machinery for the static figures (Agg canvas, never pyplot), imported quickly.

As each ``Artist`` subclass is defined, matplotlib builds a ``set()`` docstring listing all its properties
(:func:`matplotlib.artist.kwdoc`); for the hundred-odd classes ``matplotlib.figure`` pulls in that is about a fifth of
the import, for help text a figure never shows. While this module imports those modules the docstrings are left
short; nothing else changes, and nothing happens when matplotlib's figure module was imported before.
"""

from __future__ import annotations

import sys


def _import_quietly() -> None:
    if "matplotlib.figure" in sys.modules:
        return
    import matplotlib.artist as artist

    kwdoc = artist.kwdoc
    artist.kwdoc = lambda _cls: ""  # type: ignore[assignment]
    try:
        import matplotlib.backends.backend_agg  # noqa: F401  (the canvas savefig uses for png)
        import matplotlib.figure  # noqa: F401
        import matplotlib.legend_handler  # noqa: F401
    finally:
        artist.kwdoc = kwdoc


_import_quietly()
