"""Tokens and TLS from Python: a server with `[[auth.tokens]]` and a
certificate; the client's token picks its tenant, a wrong or missing one is
refused with the typed exception, and shared memory registers with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import errors

from conftest import start, stop

TLS = Path(__file__).resolve().parents[2] / "crates" / "kvtier-client" / "tests" / "tls"
ALPHA = "alpha-token-0123456789"
ADMIN = "admin-token-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("secured")
    config = root / "kvtier.toml"
    config.write_text(
        f'[[auth.tokens]]\ntoken = "{ALPHA}"\ntenant = "alpha"\n\n[[auth.tokens]]\ntoken = "{ADMIN}"\nadmin = true\n'
    )
    ca = (TLS / "ca.pem").read_bytes()
    server = start(
        root / "data",
        "--config",
        str(config),
        "--tls-cert",
        str(TLS / "server.pem"),
        "--tls-key",
        str(TLS / "server.key"),
        scheme="https",
        host="localhost",
        token=ADMIN,
        tls_ca=ca,
    )
    yield server, ca
    stop(server)


def test_token_and_tls(secured):
    server, ca = secured
    alpha = kvtier.Client(server.address, tenant="alpha", token=ALPHA, tls_ca=ca, shm_socket=server.shm_socket)
    alpha.create("s", kvtier.Layout(1, 1, 1, 4, "f32", 2))
    k = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    alpha.put("s", 0, k, k)
    region = alpha.register_shm(1 << 16)
    assert (alpha.fetch("s", 0, shm=region)[0].k == k[0]).all()
    assert alpha.stats()["tenant"] == "alpha"  # a tenant's token sees its own tenant

    with pytest.raises(errors.PermissionDenied) as e:
        kvtier.Client(server.address, tenant="beta", token=ALPHA, tls_ca=ca).info("s")
    assert e.value.field == "tenant"
    with pytest.raises(errors.Unauthenticated):
        kvtier.Client(server.address, tenant="alpha", token="wrong-token-0123456789", tls_ca=ca).info("s")
    with pytest.raises(errors.Unauthenticated):
        kvtier.Client(server.address, tenant="alpha", tls_ca=ca).info("s")
    with pytest.raises(errors.Unauthenticated):
        kvtier.Client(server.address, tenant="alpha", tls_ca=ca, shm_socket=server.shm_socket).register_shm(4096)
    # plaintext to a TLS server does not get through
    with pytest.raises(errors.Unavailable):
        kvtier.Client(server.address.replace("https", "http"), tenant="alpha", token=ALPHA).info("s")
    admin = kvtier.Client(server.address, tenant="alpha", token=ADMIN, tls_ca=ca)
    assert admin.stats()["sequences"] == 1
    alpha.drop("s")
