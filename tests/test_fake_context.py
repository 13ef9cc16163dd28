"""The CLI's fake ContextManager and the real one implement one contract, so the fake cannot drift."""

import inspect
import re
from pathlib import Path

import pytest

from kvchat.chunks.context import ContextManager
from tests.context_contract import ContextManagerContract
from tests.fake_context import FakeContextManager

CLI = Path(__file__).resolve().parent.parent / "kvchat" / "cli"
CONTRACT = {name for name in vars(ContextManagerContract) if not name.startswith("_")}
CONTRACT |= set(ContextManagerContract.__annotations__)
TYPER_CONTEXT = {"obj", "invoked_subcommand"}  # `ctx` in app.py is also typer's Context


def parameters(member) -> list[tuple[str, object, object]]:
    if isinstance(member, property):
        return []
    params = list(inspect.signature(member).parameters.values())[1:]  # without self
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("implementation", [ContextManager, FakeContextManager])
@pytest.mark.parametrize("name", sorted(CONTRACT - set(ContextManagerContract.__annotations__)))
def test_every_method_of_the_contract_has_its_signature(implementation, name):
    expected = parameters(getattr(ContextManagerContract, name))
    assert parameters(getattr(implementation, name)) == expected


@pytest.mark.parametrize("name", sorted(ContextManagerContract.__annotations__))
def test_every_attribute_of_the_contract_is_set(name):
    assert name in inspect.getsource(ContextManager.__init__)
    assert hasattr(FakeContextManager(), name)


def test_the_cli_uses_only_the_contract():
    used = set()
    for path in CLI.glob("*.py"):
        used |= set(re.findall(r"\bctx\.(\w+)", path.read_text()))
    # cache_commands.py runs the views, which need the real ContextManager and its model.
    views_only = {"tokenizer"}
    assert used - TYPER_CONTEXT - views_only <= CONTRACT
