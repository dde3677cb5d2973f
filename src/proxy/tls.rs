//! TLS configs (stub).
