"""`python -m moe_serve.server` is `moe-serve`."""
from moe_serve.server.cli import main

raise SystemExit(main())
