"""`python -m dorarl ...`: the `dorarl` command line, for a process that starts another."""

from dorarl.cli import main

raise SystemExit(main())
