"""One module per subcommand; each exposes `main(...) -> exit code` and builds a result it renders."""
