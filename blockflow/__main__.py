"""``python -m blockflow`` is the ``blockflow`` command."""

from blockflow.cli import main

main()
