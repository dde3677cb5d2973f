//! In-pod redirection (stub).
