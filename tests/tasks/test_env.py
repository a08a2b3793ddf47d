"""How `task.env=module:Class` is found: the module on the Python path or in the working
directory, and a class the module lacks named with the environments it has."""

from __future__ import annotations

import sys

import pytest

from dorarl.errors import UserInputError
from dorarl.tasks.env import load_env_class

MODULE = "dorarl_test_cwd_env"
SOURCE = """
from dorarl.tasks.env import ChatEnv, Env, EnvStep


class CountEnv(Env):
    async def reset(self, prompt):
        return ""

    async def step(self, response):
        return EnvStep("", 1.0, True)


class Helper:  # not an environment: not listed
    pass
"""


@pytest.fixture
def cwd_module(tmp_path, monkeypatch):
    """A module file in the working directory, which is not on the import path (as for the
    `dorarl` command, whose path starts at its script's folder)."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    sys.modules.pop(MODULE, None)


def test_a_module_in_the_working_directory_is_found(cwd_module):
    assert load_env_class(f"{MODULE}:CountEnv").__name__ == "CountEnv"
    assert sys.path[-1] == str(cwd_module)  # after the installed packages: it shadows none


def test_a_class_the_module_lacks_is_named_with_the_environments_it_has(cwd_module):
    with pytest.raises(UserInputError) as refused:
        load_env_class(f"{MODULE}:Nope")
    assert (
        str(refused.value)
        == f"task.env: module '{MODULE}' has no 'Nope' (its environments: CountEnv)"
    )
    with pytest.raises(UserInputError, match="has no 'Nope' \\(it defines no Env or ChatEnv\\)"):
        load_env_class("json:Nope")
    with pytest.raises(UserInputError, match="'json:dumps' is not a subclass"):
        load_env_class("json:dumps")


def test_a_module_nowhere_says_where_it_was_looked_for(cwd_module):
    with pytest.raises(UserInputError) as refused:
        load_env_class("no_such_module_xyz:Env")
    assert f"from the Python path or {cwd_module} (" in str(refused.value)
