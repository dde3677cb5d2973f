//! Multi-call entry point: `argv[0]` basename picks the role, otherwise the `ztnode` CLI.

use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

fn main() {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let base = std::path::Path::new(&argv0)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if base == "ztnode-cni" {
        std::process::exit(ztnode::plugin::main());
    }
    // `ztnode cni` runs the plugin too (handy before the symlink exists).
    if std::env::args().nth(1).as_deref() == Some("cni") {
        std::process::exit(ztnode::plugin::main());
    }
}
