"""``python -m flashckpt.cli``: the ``flashckpt`` command."""

from . import main

main()
