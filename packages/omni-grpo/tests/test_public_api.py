"""The package's public face: a few names at the top, resolved lazily."""

from __future__ import annotations

import subprocess
import sys

import omni_grpo


def test_every_public_name_resolves_to_its_home_module() -> None:
    for name in omni_grpo.__all__:
        obj = getattr(omni_grpo, name)
        assert obj.__module__ == omni_grpo._EXPORTS[name], name


def test_import_is_light() -> None:
    """``import omni_grpo`` (and so ``omni-grpo --help``) does not pull in torch or transformers."""
    code = "import sys, omni_grpo, omni_grpo.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        omni_grpo.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("expected AttributeError")
