"""The ``agentbolt`` command line: ``main`` holds the commands, ``export`` and ``demo`` theirs."""
