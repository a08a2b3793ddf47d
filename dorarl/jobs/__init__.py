"""Entry jobs behind the `dorarl` command: one module per job, each `main(argv) -> int`."""
