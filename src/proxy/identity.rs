//! Identities and the built-in CA (stub).
