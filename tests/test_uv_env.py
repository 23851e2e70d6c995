"""tools/uv_env.py: uv gets the package sources pip is configured with (else a fresh install resolves torch from
PyPI: a multi-GB CUDA build)."""

import pytest

from tools.uv_env import pip_settings, uv_exports

pytestmark = pytest.mark.fast


def test_pips_settings_become_uvs_variables_with_the_environment_winning_over_files():
    listing = "\n".join([
        ":env:.find-links='/opt/wheels'",
        "global.find-links='/elsewhere'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "user.index-url='https://ignored.example/simple'",
    ])
    exports = uv_exports(pip_settings(listing))
    assert "export UV_FIND_LINKS=/opt/wheels" in exports  # PIP_FIND_LINKS beats the file's value, as in pip
    assert "export UV_EXTRA_INDEX_URL='file:///opt/pypi/simple file:///opt/pypi-more/simple'" in exports
    assert "export UV_CONSTRAINT=/etc/xdg/pip/constraints.txt" in exports
    assert "export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in exports
    assert "export UV_INDEX_STRATEGY=unsafe-best-match" in exports  # pip's best version over all sources
    assert not any("UV_INDEX_URL" in line for line in exports)  # only global/install/env sections count


def test_no_pip_configuration_sets_nothing():
    assert uv_exports(pip_settings("")) == []
