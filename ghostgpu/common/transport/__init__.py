"""The transport room: addresses, dialing the collector, TLS (files, reload, identities, errors
explained) and who a peer is (certificate principal, socket owner)."""
