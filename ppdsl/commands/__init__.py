"""One module per `ppdsl` subcommand: `HELP`, `add_arguments(parser)`, `run(args) -> int`."""
