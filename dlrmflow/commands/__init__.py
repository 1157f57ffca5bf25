"""One module per CLI command.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(args) -> dict``
(the JSON result; it runs the command's Prefect flow) and ``summarize(result) -> str``
(the human summary). ``dlrmflow.cli`` lists the modules in ``COMMANDS``. Optional: ``check(args)`` (the
options' checks, before Prefect loads), ``starts_local_cluster(args)`` (whether its flow will start a LocalCluster,
whose workers' server the CLI then starts at launch), ``workers_use_torch(args)`` (False: no worker will train or
score, so their server skips importing torch; True if absent) and ``trains_on_cluster(args)`` (whether trainers
run on those workers).
"""


def starts_local_cluster(args: object) -> bool:
    """``starts_local_cluster`` of a command whose flow always starts a LocalCluster (unless given a Dask address):
    such a module imports this one."""
    return True


def workers_use_torch(args: object) -> bool:
    """``workers_use_torch`` of a command whose workers only read, write, count or plan data: such a module
    imports this one."""
    return False
