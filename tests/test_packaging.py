"""What a user's tools see of the installed package."""

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
