"""The ``cb`` command line: one module per subcommand, and the config files they read (``config_files``)."""
