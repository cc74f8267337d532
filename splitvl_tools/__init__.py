"""splitvl's tools, apart from the product: ``splitvl bench``, ``cache-eval``, ``cache-bench``,
``load`` and ``soak``, and the workload generator they share.

They plug their subcommands into the ``splitvl`` command through the ``splitvl.commands``
entry points (pyproject.toml), so imports go one way only: the tools use the product
(launcher, client, checkpoint builder), the product never imports the tools.
"""
