//! The code layout (`layout/symbol-order.txt`, linked into the musl release binary by build.rs)
//! names symbols by their mangled names, whose hashes change with every `Cargo.lock` and
//! toolchain: a stale file leaves most of the binary in the default order, and only
//! `scripts/build-static.sh` (not run by CI) would notice. The file records the `Cargo.lock` and
//! the toolchain it was made for; this checks the `Cargo.lock` (the toolchain is the builder's:
//! one other than the recorded one gets `build-static.sh`'s warning, not a failing test).

use std::path::Path;

/// The value of the header line `# <key>: <value>` of the layout file.
fn header<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .find_map(|l| l.strip_prefix("# ")?.strip_prefix(key)?.strip_prefix(": "))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn the_code_layout_was_made_for_this_cargo_lock() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layout = std::fs::read_to_string(root.join("layout/symbol-order.txt")).expect("layout");
    let lock = std::fs::read(root.join("Cargo.lock")).expect("Cargo.lock");
    let digest = hex(ring::digest::digest(&ring::digest::SHA256, &lock).as_ref());
    assert_eq!(
        header(&layout, "Cargo.lock sha256"),
        Some(digest.as_str()),
        "layout/symbol-order.txt was made for another Cargo.lock: run scripts/symbol-order.sh"
    );
}

#[test]
fn header_lines_are_found_only_in_the_header() {
    let text =
        "# a\n# Cargo.lock sha256: ab12\n# toolchain: rustc 1.0\nsym\n# Cargo.lock sha256: ff\n";
    assert_eq!(header(text, "Cargo.lock sha256"), Some("ab12"));
    assert_eq!(header(text, "toolchain"), Some("rustc 1.0"));
    assert_eq!(
        header("sym\n# Cargo.lock sha256: ab\n", "Cargo.lock sha256"),
        None
    );
    assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
}
