"""``python -m tessera`` is the ``tessera`` command."""

from tessera.cli import main

raise SystemExit(main())
