//! The CNI plugin role (`ztnode-cni`). Owned by the plugin work; see issue 2.

/// Runs the plugin with the process environment, stdin and stdout; returns the exit status.
pub fn main() -> i32 {
    0
}
