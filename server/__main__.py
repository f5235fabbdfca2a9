"""`python -m server` is `moe-serve`."""
from server.cli import main

raise SystemExit(main())
