"""What a user's tools see of the installed package."""

import importlib
import importlib.resources

import lowbit


def test_the_package_is_typed():
    """PEP 561: type checkers read lowbit's annotations only when ``py.typed`` ships with it."""
    assert importlib.resources.files(lowbit).joinpath("py.typed").is_file()


def test_help_of_moniqua_says_what_theta_is():
    from lowbit.algorithms import Moniqua
    from lowbit.codecs import ModuloCodec

    for cls in (ModuloCodec, Moniqua):
        assert "Parameters" in cls.__doc__ and "theta:" in cls.__doc__, cls


def public_names_without_docstrings() -> list[str]:
    """Every module-level class and function of lowbit whose name has no leading underscore,
    defined in that module, and whose ``help()`` would be empty."""
    import inspect
    import pkgutil

    missing = []
    for info in pkgutil.walk_packages(lowbit.__path__, "lowbit."):
        if info.name.endswith("__main__"):  # running it is the CLI
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) == mod.__name__ and not (obj.__doc__ or "").strip():
                missing.append(f"{mod.__name__}.{name}")
    return missing


def test_every_public_name_has_a_docstring():
    assert public_names_without_docstrings() == []


def test_importing_lowbit_leaves_torchs_allocator_settings_alone():
    """lowbit advises its own large outputs (kernels.empty_output), not every tensor of the process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = "import os, lowbit, lowbit.codecs; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
