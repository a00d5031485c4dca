import pytest

# The folder a test lives in says what it needs: mark it so that `-m "not gpu"` and the like select.
_FOLDER_MARKS = {"gpu": pytest.mark.gpu, "multigpu": pytest.mark.multigpu}


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
