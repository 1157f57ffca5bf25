"""One module per CLI command.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(args) -> dict``
(the JSON result; it runs the command's Prefect flow) and ``summarize(result) -> str``
(the human summary). ``dlrmflow.cli`` lists the modules in ``COMMANDS``.
"""
