"""The CLI holds its ContextManager typed as the contract (kvchat/chunks/contract.py), so mypy lets it
use nothing else; the real manager and the CLI's fake both implement the contract, so the fake cannot
drift."""

import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kvchat.chunks.context import ContextManager
from kvchat.chunks.contract import ContextManagerContract
from kvchat.cli.commands import Shell
from tests.support.fake_context import FakeContextManager

ROOT = Path(__file__).resolve().parent.parent
ATTRIBUTES = set(ContextManagerContract.__annotations__)
METHODS = {name for name in vars(ContextManagerContract) if not name.startswith("_")} - ATTRIBUTES


def parameters(member) -> list[tuple[str, object, object]]:
    if isinstance(member, property):
        return []
    params = list(inspect.signature(member).parameters.values())[1:]  # without self
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("implementation", [ContextManager, FakeContextManager])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_of_the_contract_has_its_signature(implementation, name):
    expected = parameters(getattr(ContextManagerContract, name))
    assert parameters(getattr(implementation, name)) == expected


@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_every_attribute_of_the_contract_is_set(name):
    assert name in inspect.getsource(ContextManager.__init__)
    assert hasattr(FakeContextManager(), name)


def test_the_shell_holds_its_manager_as_the_contract():
    assert typing.get_type_hints(Shell)["ctx"] is ContextManagerContract


@pytest.mark.slow  # mypy over the CLI: tens of seconds without its cache
def test_mypy_lets_the_cli_use_only_the_contract(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from kvchat.cli.commands import Shell\n\n\n"
        "def probe(shell: Shell) -> None:\n"
        "    shell.ctx.stats()\n"
        "    shell.ctx.tokenizer  # the real manager has it; the contract does not\n"
    )
    args = ["-m", "mypy", "kvchat/cli", str(probe), "--ignore-missing-imports", "--no-error-summary"]
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, done.stdout + done.stderr
    assert errors[0].startswith(f"{probe}:6: error: ") and '"tokenizer"' in errors[0], errors[0]
