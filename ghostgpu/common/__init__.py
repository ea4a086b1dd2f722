"""The shared floor (ARCHITECTURE.md): what the tracer, the collector and the commands all speak.

It is split into rooms, each a package: model (plain data and every class rule), wire (the one
mapping to the generated API), transport (addresses, dialing, TLS, peers), web (the HTTP server and
its web config), audit (the hash chain) and system (fd limits, file modes, loop threads, config files
and flags, file watching). It imports only the generated code below it.
"""
