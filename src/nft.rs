//! nf_tables over netlink (stub).
