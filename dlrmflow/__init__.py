"""dlrmflow: train DLRMs with huge embedding tables, fast and fault tolerant.

Subpackages (top-level folders of the repository, fixed by the project card):
``dlrmflow.datasets`` formats, readers and generators; ``dlrmflow.engine`` the algorithms,
importable without Prefect; ``dlrmflow.tasks`` and ``dlrmflow.flows`` the thin Prefect layer.
"""

__version__ = "0.1.0"
