"""The collector's TLS credentials, re-read when their files change: rotation without a restart.

cert-manager rewrites a mounted Secret in place (kubelet swaps a symlink); an operator may copy new
files over the old ones. gRPC's dynamic server credentials ask `CertReloader.fetch` at every new
handshake (once per connection, not per call) whether the configuration changed. The answer must be
cheap, so it stats the three files (ghostgpu/common/system/filewatch.py: a few microseconds) and
reads them only when one moved. A complete, valid new set is served from the next handshake on; a bad
one (half-written, a key that does not match yet, expired) keeps the current set and is reported
once per change of the files, not once per handshake. Connections already open keep the session
they negotiated: a rotation never cuts a tracer's stream.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from ghostgpu.common.system.filewatch import FileWatch
from ghostgpu.common.transport.tls import Loaded, TlsError, TlsFiles, check_server

log = logging.getLogger(__name__)

RELOAD = "tls.reload"
RELOAD_ERROR = "tls.reload_error"

OnReload = Callable[[str, str], None]  # (action, one line): the audit's tls.reload / tls.reload_error


def _configuration(loaded: Loaded) -> grpc.ServerCertificateConfiguration:
    assert loaded.key_pem is not None and loaded.cert_pem is not None  # check_server demands both
    return grpc.ssl_server_certificate_configuration([(loaded.key_pem, loaded.cert_pem)],
                                                     root_certificates=loaded.ca_pem)


class CertReloader:
    """The served certificate set and the check gRPC runs per handshake. Raises TlsError at
    construction when the files are not a valid set: a collector must not start without one."""

    def __init__(self, files: TlsFiles, on_reload: OnReload) -> None:
        self.files = files
        self._on_reload = on_reload
        self._lock = threading.Lock()  # gRPC may run handshakes on several threads
        self._watch = FileWatch((files.cert, files.key, files.ca))
        self.current = check_server(files)
        self.reloads = 0
        self.errors = 0

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for add_secure_port: client certificates required and verified by --tls-ca."""
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self.current),
            self.fetch,  # type: ignore[arg-type]  # gRPC takes None (no change); typeshed's stub does not
            require_client_authentication=True)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed into a valid set, else None
        (keep serving the current one). Never raises: a failed handshake would be the only sign."""
        report: tuple[str, str] | None = None
        answer = None
        try:
            with self._lock:
                if not self._watch.poll():
                    return None
                try:
                    loaded = check_server(self.files)
                except TlsError as exc:
                    self.errors += 1
                    report = (RELOAD_ERROR, f"{exc}; still serving {self.current.describe()}")
                else:
                    same = (loaded.cert_pem, loaded.key_pem, loaded.ca_pem) == (
                        self.current.cert_pem, self.current.key_pem, self.current.ca_pem)
                    if not same:  # touched, or read twice around one write: nothing to announce
                        self.current = loaded
                        self.reloads += 1
                        answer = _configuration(loaded)
                        report = (RELOAD, f"{self.files.label('cert')} {self.files.cert}: now serving "
                                  f"{loaded.describe()}")
        except Exception:  # a bug here must not fail every handshake
            log.exception("TLS reload check failed; still serving the current certificate")
            return None
        if report is not None:
            log.log(logging.WARNING if report[0] == RELOAD_ERROR else logging.INFO, "%s: %s", *report)
            try:
                self._on_reload(*report)
            except Exception:  # the audit's trouble must not fail the handshake
                log.exception("TLS reload callback failed")
        return answer


def server_credentials(files: TlsFiles, on_reload: OnReload) -> grpc.ServerCredentials:
    """The collector's TLS credentials for add_secure_port: mTLS, re-read when the files change.
    TlsError (one line) when the files are not a valid set now."""
    return CertReloader(files, on_reload).credentials()
