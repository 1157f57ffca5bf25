"""Prefect tasks: thin wrappers over engine functions, each made with :func:`task`."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


def task(**options: Any) -> Callable[[Callable[..., T]], Any]:
    """``prefect.task(**options)``, whose runs carry only their own tags, none of the calling ``tags()`` context's.
    Every task of this package is made with it.

    Why: before each tagged task run, Prefect asks the API for the concurrency limits of its tags
    (``tag:...``), remembering a tag set without limits for 5 s only. That request opens a write transaction,
    which on a SQLite database (``prefect server start``'s default and the temporary API's) waits while the
    server writes a run's logs and events: about 2 s for the report task after a training run of ``make run``.
    dlrmflow's tags describe flow runs (the UI filters runs by them: they stay there); its
    task runs are the steps inside one.

    ``TagsContext`` (``prefect.context``) is what ``prefect.tags`` enters and the task engine reads when it
    creates a task run in the calling thread."""

    def make(fn: Callable[..., T]) -> Any:
        return _own_tags_only_task()(fn=fn, **options)

    return make


@cache
def _own_tags_only_task() -> type:
    """The Task class :func:`task` makes: its calls leave the caller's tags out (made once, when the first task
    is: this package's import stays free of Prefect)."""
    import prefect
    from prefect.context import TagsContext

    class OwnTagsOnly(prefect.Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with TagsContext(current_tags=set()):
                return super().__call__(*args, **kwargs)

    return OwnTagsOnly
