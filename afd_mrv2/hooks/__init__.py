"""Built-in connectors, registered through the ``afd_mrv2`` entry-point group
exactly as a third-party distribution registers its own (see ``pyproject.toml``)."""
