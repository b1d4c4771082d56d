"""``python -m umopt.cli``: the same as the ``umopt`` command."""

from . import main

main()
