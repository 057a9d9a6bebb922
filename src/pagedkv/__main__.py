"""`python -m pagedkv` runs the CLI."""

from pagedkv.cli import main

raise SystemExit(main())
