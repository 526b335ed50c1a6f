"""How a client reaches shards that ask for TLS or tokens (server/security.py): a CA to
trust, a client certificate for mutual TLS, and a bearer token.

    security = ChannelSecurity(ca_file="ca.pem", token=read_token("/run/secrets/token"))
    EmbeddingClient(addresses, security=security)

`ChannelSecurity.from_env()` reads TIERPS_TLS_CA, TIERPS_TLS_CERT, TIERPS_TLS_KEY,
TIERPS_TLS_SERVER_NAME and the token from TIERPS_TOKEN_FILE or TIERPS_TOKEN (never from a
command line: a process list shows it)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "TIERPS_TOKEN"
TOKEN_FILE_ENV = "TIERPS_TOKEN_FILE"
AUTH_HEADER = "authorization"  # as server/security.py reads it


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in a file (its first line, without surrounding whitespace)."""
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"token file {path}: expected a token, got an empty file")
    return text.splitlines()[0].strip()


@dataclass(frozen=True)
class ChannelSecurity:
    """ca_file: PEM CA the shards' certificates are checked against (None: no TLS, or with
    cert_file, the system's roots). cert_file / key_file: this client's certificate and key
    (mutual TLS). server_name: the name the shards' certificates carry when it is not the
    host of their addresses. token: sent as `authorization: Bearer TOKEN` on every call."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                f"ChannelSecurity: cert_file and key_file expected both or neither, got "
                f"cert_file={self.cert_file}, key_file={self.key_file}"
            )
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("ChannelSecurity: token expected non-empty, without whitespace")

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    @classmethod
    def from_env(cls, **overrides: Any) -> ChannelSecurity:
        """From the TIERPS_TLS_* and TIERPS_TOKEN[_FILE] environment variables; overrides
        that are not None win."""
        env = os.environ.get
        token_file = overrides.pop("token_file", None) or env(TOKEN_FILE_ENV)
        values: dict[str, Any] = {
            "ca_file": env("TIERPS_TLS_CA"),
            "cert_file": env("TIERPS_TLS_CERT"),
            "key_file": env("TIERPS_TLS_KEY"),
            "server_name": env("TIERPS_TLS_SERVER_NAME"),
            "token": read_token(token_file) if token_file else env(TOKEN_ENV),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in ("ca_file", "cert_file", "key_file"):
            if values[name]:
                values[name] = Path(values[name])
        return cls(**{k: v or None for k, v in values.items()})

    def metadata(self) -> list[tuple[str, str]]:
        return [] if self.token is None else [(AUTH_HEADER, f"Bearer {self.token}")]

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to address: TLS where a CA or a client certificate is given."""
        if not self.tls:
            return grpc.insecure_channel(address, options=list(options))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=None if self.ca_file is None else Path(self.ca_file).read_bytes(),
            private_key=None if self.key_file is None else Path(self.key_file).read_bytes(),
            certificate_chain=None if self.cert_file is None else Path(self.cert_file).read_bytes(),
        )
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, credentials, options=list(options))


NO_SECURITY = ChannelSecurity()


def add_arguments(parser: Any) -> None:
    """The client's flags (argparse): --tls-ca, --tls-client-cert, --tls-client-key,
    --tls-server-name, --token-file; each defaults to its TIERPS_* environment variable."""
    group = parser.add_argument_group("TLS and token (client side)")
    group.add_argument(
        "--tls-ca",
        type=Path,
        help="PEM CA of the shards' certificates (turns TLS on; $TIERPS_TLS_CA)",
    )
    group.add_argument(
        "--tls-client-cert",
        type=Path,
        help="this client's PEM certificate, for mutual TLS ($TIERPS_TLS_CERT)",
    )
    group.add_argument(
        "--tls-client-key",
        type=Path,
        help="this client's PEM key, for mutual TLS ($TIERPS_TLS_KEY)",
    )
    group.add_argument(
        "--tls-server-name",
        help="the name in the shards' certificates, if "
        "not their addresses' host ($TIERPS_TLS_SERVER_NAME)",
    )
    group.add_argument(
        "--token-file",
        type=Path,
        help="a file holding this client's bearer "
        "token ($TIERPS_TOKEN_FILE, or the token in $TIERPS_TOKEN)",
    )


def from_args(args: Any) -> ChannelSecurity:
    """ChannelSecurity from add_arguments' flags, the environment filling what they leave."""
    return ChannelSecurity.from_env(
        ca_file=args.tls_ca,
        cert_file=args.tls_client_cert,
        key_file=args.tls_client_key,
        server_name=args.tls_server_name,
        token_file=args.token_file,
    )
