"""What each notebook's prose promises about its figures, checked on the objects it drew.

``PROMISES[stem]`` is Python run in the notebook's own kernel right after its last cell
(by ``tests/test_notebooks.py``), so it sees the notebook's variables. Each check quotes the
sentence it holds the notebook to. A notebook without an entry is only run.
"""

PROMISES: dict[str, str] = {}
