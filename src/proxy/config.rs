//! Local config (stub).
