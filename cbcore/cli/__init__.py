"""The ``cb`` command line: one module per subcommand."""
